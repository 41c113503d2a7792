import numpy as np
import PIL.Image
import pytest

from captioner.decoding.captioner import Caption
from captioner.model.encoder import Cells
from captioner.pictures.figures import attention_figure, grid_shape, plot_attention
from captioner.pictures.overlay import heat, render_attention, upsample, word_focus


def _caption(n_words: int, size=(96, 64), grid=(4, 6)) -> Caption:
    rng = np.random.default_rng(n_words)
    attention = rng.random((n_words, *grid)).astype(np.float32) ** 4  # (T, H', W'), peaky
    attention /= attention.sum(axis=(1, 2), keepdims=True)
    words = [f"word{i}" for i in range(n_words)]
    return Caption(" ".join(words), words, -1.0, -2.0, attention, size)


def _photo(size=(96, 64)) -> PIL.Image.Image:
    x = np.linspace(0, 255, size[0], dtype=np.uint8)
    return PIL.Image.fromarray(np.stack([np.tile(x, (size[1], 1))] * 3, axis=-1))


def test_grid_shape_is_near_square():
    assert grid_shape(2) == (1, 2)
    assert grid_shape(8) == (3, 3)
    assert grid_shape(31) == (6, 6)


def test_upsample_is_smooth_and_keeps_the_peak_where_it_was():
    m = np.zeros((4, 4), np.float32)
    m[1, 2] = 1.0
    up = upsample(m, (80, 40))  # (w, h)
    assert up.shape == (40, 80) and up.min() >= 0
    y, x = np.unravel_index(up.argmax(), up.shape)
    assert 10 <= y < 20 and 40 <= x < 60  # inside the cell (row 1, col 2)
    assert 0 < up[15, 30] < up[y, x]  # smooth: the neighbour cell is warm, not 0


def test_render_attention_keeps_the_image_size():
    out = render_attention(_photo(), _caption(1).attention[0])
    assert out.size == (96, 64) and out.mode == "RGB"


def _change(picture: PIL.Image.Image, photo: PIL.Image.Image) -> np.ndarray:
    """(h, w) how far each pixel moved from the photo."""
    return np.abs(np.asarray(picture, np.float32) - np.asarray(photo, np.float32)).sum(-1)


def test_colours_are_on_one_fixed_scale_not_stretched_per_map():
    """An even map leaves the photo as it was; a map gathered on one cell colours that cell strongly;
    a map twice as spread (same shape, half the peak) is visibly fainter, not re-stretched to look alike."""
    photo = _photo()
    even = np.full((4, 6), 1 / 24, np.float32)
    assert _change(render_attention(photo, even), photo).max() < 1.0
    sharp = np.full((4, 6), 0.2 / 23, np.float32)
    sharp[1, 2] = 0.8
    flatter = 0.5 * sharp + 0.5 * even
    strong, faint = _change(render_attention(photo, sharp), photo), _change(render_attention(photo, flatter), photo)
    assert strong.max() > 150 and faint.max() < 0.9 * strong.max() and faint.sum() < 0.9 * strong.sum()
    assert heat(np.array([1 / 24, 2 / 24, 1.0]), 24) == pytest.approx([0.0, np.log(2) / np.log(24), 1.0])


def test_word_focus_is_peak_and_normalised_entropy():
    assert word_focus(np.full((4, 4), 1 / 16)) == pytest.approx((1 / 16, 1.0))
    one = np.zeros((4, 4))
    one[2, 3] = 1.0
    assert word_focus(one) == pytest.approx((1.0, 0.0))


@pytest.mark.parametrize("n_words", [1, 30])
def test_plot_attention_writes_a_png_for_short_and_long_captions(tmp_path, n_words):
    path = plot_attention(_photo(), _caption(n_words), tmp_path / "out" / "grid.png", dpi=40)
    with PIL.Image.open(path) as im:
        assert im.format == "PNG"
        rows, cols = grid_shape(n_words + 1)
        assert im.width > cols * 40 and im.height > rows * 40  # a panel per word, each of a readable size


def test_plot_attention_writes_per_word_pngs_and_a_gif(tmp_path):
    caption = _caption(3)
    plot_attention(_photo(), caption, tmp_path / "grid.png", dpi=40, per_word_dir=tmp_path / "words",
                   gif_path=tmp_path / "anim.gif")
    assert [p.name for p in sorted((tmp_path / "words").glob("*.png"))] == ["01_word0.png", "02_word1.png",
                                                                            "03_word2.png"]
    with PIL.Image.open(tmp_path / "anim.gif") as gif:
        assert gif.n_frames == 4  # the photo, then one frame per word


def test_plot_attention_rejects_mismatched_maps(tmp_path):
    caption = _caption(3)
    caption.tokens = caption.tokens[:2]
    with pytest.raises(ValueError, match="2 words but 3"):
        plot_attention(_photo(), caption, tmp_path / "x.png")


def test_upsample_places_each_weight_at_its_cells_centre():
    one_hot = np.zeros((4, 4), dtype=np.float32)
    one_hot[1, 1] = 1.0  # nominal centre of cell (1, 1) at pixel 15 of 40 (cells of 10 px)
    plain = upsample(one_hot, (40, 40))
    assert np.unravel_index(plain.argmax(), plain.shape) == (14, 14)  # pixel 14 spans [14, 15): centre 14.5
    moved = upsample(one_hot, (40, 40), Cells(origin=0.2, stride=0.25))  # cell 1 centred at 0.45 * 40 = 18 px
    assert np.unravel_index(moved.argmax(), moved.shape) in ((17, 17), (17, 18), (18, 17), (18, 18))
    wide = upsample(one_hot, (80, 40), Cells(origin=0.2, stride=0.25))  # the same fractions on a wider image
    y, x = np.unravel_index(wide.argmax(), wide.shape)
    assert y in (17, 18) and x in (35, 36)


@pytest.mark.parametrize("grid, size, cells", [((12, 12), (333, 500), Cells(0.04, 0.0833)), ((4, 6), (37, 91), None),
                                               ((3, 3), (40, 40), Cells(0.2, 0.25)), ((1, 1), (9, 7), None)])
def test_upsample_is_torchs_bicubic_grid_sample_with_border_padding(grid, size, cells):
    """The numpy interpolation (no torch to draw a picture) is the torch one it replaced, to float32 rounding."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(0)
    m = rng.random(grid).astype(np.float32)  # (H', W')
    w, h = size
    rows, cols = grid
    x_cells, y_cells = cells or Cells(0.5 / cols, 1.0 / cols), cells or Cells(0.5 / rows, 1.0 / rows)

    def at(n, pixels, origin, stride):  # grid_sample's coordinates of the pixel centres: cell j at -1 + 2j/(n-1)
        index = ((torch.arange(pixels) + 0.5) / pixels - origin) / stride
        return index * (2 / (n - 1)) - 1 if n > 1 else torch.zeros(pixels)

    where = torch.stack(torch.meshgrid(at(cols, w, *x_cells), at(rows, h, *y_cells), indexing="xy"), dim=-1)[None]
    want = F.grid_sample(torch.from_numpy(m)[None, None], where, mode="bicubic", padding_mode="border",
                         align_corners=True)[0, 0].clamp_min(0).numpy()  # (h, w)
    np.testing.assert_allclose(upsample(m, size, cells), want, atol=1e-5, rtol=0)  # weights up to 1: float32


def test_drawing_a_picture_imports_neither_torch_nor_timm():
    import subprocess
    import sys

    code = ("import sys, captioner.pictures.figures, captioner.deploy.lite; "
            "print(sorted(m for m in ('torch', 'timm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_boxes_are_outlined_green_for_a_hit_and_red_for_a_miss(tmp_path):
    """word0 peaks in the left half, word1 in the right: with a box on the left for both, word0's panel
    gets a green outline and word1's a red one."""
    from captioner.data.boxes import GroundObject
    from captioner.pictures.figures import attention_figure, word_looks

    attention = np.full((2, 4, 6), 0.1 / 23, dtype=np.float32)
    attention[0, 1, 1] = attention[1, 1, 4] = 0.9
    caption = Caption("word0 word1", ["word0", "word1"], -1.0, -2.0, attention, (96, 64))
    objects = [GroundObject(("word0",), ((0, 0, 40, 64),)), GroundObject(("word1",), ((0, 0, 40, 64),))]
    found = word_looks(caption, objects)
    assert [found[t][0].hit for t in (0, 1)] == [True, False]
    fig = attention_figure(_photo(), caption, objects=objects)
    titles = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert set(titles) >= {"word0 (hit)", "word1 (miss)"}
    edge = {t: [p.get_edgecolor()[:3] for p in titles[t].patches] for t in ("word0 (hit)", "word1 (miss)")}
    assert edge["word0 (hit)"] == [(0.0, 1.0, 0.0)] and edge["word1 (miss)"] == [(1.0, 0.0, 0.0)]


def test_relevance_maps_are_drawn_under_their_own_name():
    headings = lambda fig: " ".join(" ".join(t.get_text().split()) for t in fig.texts)  # noqa: E731
    assert "gradient relevance" in headings(attention_figure(_photo(), _caption(3), relevance=True))
    assert "relevance" not in headings(attention_figure(_photo(), _caption(3)))


def test_cli_visualize_with_boxes(tmp_path, capsys):
    import json

    import torch

    from captioner.cli import main
    from captioner.config import Config, DecoderConfig, EncoderConfig, ModelConfig
    from captioner.data.vocab import build_vocabulary
    from captioner.model import build_model
    from captioner.model.checkpoint import save_checkpoint

    model_cfg = ModelConfig(EncoderConfig(name="random", image_size=64),
                            DecoderConfig(embed_dim=8, hidden_dim=16, attention_dim=8, feature_dim=8, dropout=0.0))
    vocab = build_vocabulary(["a dog on grass", "a dog runs"])
    ckpt = save_checkpoint(tmp_path / "m.pt", Config(model=model_cfg), vocab,
                           build_model(model_cfg, len(vocab), pretrained=False).state_dict())
    photo = tmp_path / "dog.png"
    _photo().save(photo)
    boxes = tmp_path / "boxes.jsonl"
    boxes.write_text(json.dumps({"image": "dog.png", "objects": [{"words": ["dog"], "boxes": [[0, 0, 50, 50]]}]}))
    out = tmp_path / "v.png"
    torch.manual_seed(0)
    code = main(["visualize", str(photo), "--checkpoint", str(ckpt), "--boxes", str(boxes), "-o", str(out),
                 "--text", "a dog", "--device", "cpu"])
    assert code == 0 and PIL.Image.open(out).size[0] > 100
    code = main(["visualize", str(photo), "--checkpoint", str(ckpt), "-o", str(tmp_path / "r.png"), "--relevance",
                 "--device", "cpu"])
    assert code == 0 and PIL.Image.open(tmp_path / "r.png").size[0] > 100
    code = main(["visualize", str(photo), "--checkpoint", str(ckpt), "-o", str(tmp_path / "r.png"), "--relevance",
                 "--runtime", "onnx"])
    assert code != 0 and "use --runtime torch" in capsys.readouterr().err
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"image": "cat.png", "objects": []}))
    code = main(["visualize", str(photo), "--checkpoint", str(ckpt), "--boxes", str(other), "-o", str(out),
                 "--device", "cpu"])
    assert code != 0 and "no boxes for dog.png" in capsys.readouterr().err
