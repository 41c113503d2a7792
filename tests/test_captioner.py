import json

import numpy as np
import PIL.Image
import pytest
import torch

from captioner.cli import main
from captioner.config import Config, DataConfig, DecodeConfig, DecoderConfig, EncoderConfig, ModelConfig
from captioner.data.images import ImageError
from captioner.data.vocab import build_vocabulary
from captioner.decoding.captioner import Captioner
from captioner.decoding.metrics import caption_metrics
from captioner.model import build_model
from captioner.model.checkpoint import save_checkpoint

CAPTIONS = ["a red circle to the left of a blue square", "a green triangle above a yellow circle",
            "there is a purple square"]
MODEL = ModelConfig(encoder=EncoderConfig(name="random", image_size=64),
                    decoder=DecoderConfig(embed_dim=16, hidden_dim=32, attention_dim=16, dropout=0.0))


def _save(path, **sections):
    """A checkpoint of an untrained model; `sections` (data=..., decode=...) go into its config."""
    vocab = build_vocabulary(CAPTIONS)
    model = build_model(MODEL, len(vocab), pretrained=False)
    with torch.no_grad():
        model.decoder.readout.weight.mul_(4.0)  # peaked word distributions: no near-ties between batch sizes
    return save_checkpoint(path, Config(model=MODEL, **sections), vocab, model.state_dict())


@pytest.fixture
def checkpoint(tmp_path):
    return _save(tmp_path / "tiny.pt")


def _image(seed: int, size=(80, 60)) -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    return PIL.Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "images"
    d.mkdir()
    for i in range(3):
        _image(i, (80 + 10 * i, 60)).save(d / f"im{i}.png")
    (d / "im1_corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg")
    (d / "notes.txt").write_text("not an image, skipped by extension")
    return d


def test_a_two_scale_model_maps_every_word_over_the_finer_grid(tmp_path):
    vocab = build_vocabulary(CAPTIONS)
    cfg = ModelConfig(encoder=EncoderConfig(name="random", image_size=64, two_scale=True), decoder=MODEL.decoder)
    model = build_model(cfg, len(vocab), pretrained=False)
    path = save_checkpoint(tmp_path / "two.pt", Config(model=cfg), vocab, model.state_dict())
    captioner = Captioner.from_checkpoint(path, device="cpu", decode=DecodeConfig(beam_size=2, max_length=5))
    (caption,) = captioner.caption([_image(0)])
    assert captioner.grid == (8, 8) and caption.attention.shape == (len(caption.tokens), 8, 8)
    assert caption.cells.stride == 0.125  # the stride-8 stage of the 64-px random CNN: 8 px
    np.testing.assert_allclose(caption.attention.sum(axis=(1, 2)), 1.0, atol=1e-5)


def test_captions_carry_normalised_attention_per_word(checkpoint):
    captioner = Captioner.from_checkpoint(checkpoint, device="cpu", decode=DecodeConfig(beam_size=3, max_length=6))
    images = [_image(i) for i in range(5)]
    captions = captioner.caption(images, batch_size=2)
    assert len(captions) == 5 and captioner.grid == (4, 4)
    for c, im in zip(captions, images):
        assert c.tokens and c.text == " ".join(c.tokens) and c.image_size == im.size and c.path is None
        assert c.attention.dtype == np.float32 and c.attention.shape == (len(c.tokens), 4, 4)
        np.testing.assert_allclose(c.attention.sum(axis=(1, 2)), 1.0, rtol=0, atol=1e-6)
        assert not {"<pad>", "<start>", "<end>", "<unk>"} & set(c.tokens)
    together = captioner.caption(images, batch_size=5)
    assert [c.text for c in together] == [c.text for c in captions]
    np.testing.assert_allclose([c.score for c in together], [c.score for c in captions], atol=1e-5)


def test_decode_overrides(checkpoint):
    captioner = Captioner.from_checkpoint(checkpoint, device="cpu")
    assert captioner.decode == DecodeConfig()
    (short,) = captioner.caption([_image(0)], beam_size=1, max_length=2)
    assert 1 <= len(short.tokens) <= 2
    with pytest.raises(TypeError, match="beam"):
        captioner.caption([_image(0)], beam=2)


def test_decode_settings_come_from_the_checkpoint(tmp_path):
    path = _save(tmp_path / "m.pt", decode=DecodeConfig(beam_size=2, max_length=7))
    assert Captioner.from_checkpoint(path, device="cpu").decode == DecodeConfig(beam_size=2, max_length=7)


def test_caption_files_skips_unreadable_images_in_order(checkpoint, folder):
    captioner = Captioner.from_checkpoint(checkpoint, device="cpu")
    paths = sorted(str(p) for p in folder.glob("im*"))
    results = list(captioner.caption_files(paths, batch_size=2, beam_size=2, max_length=4))
    assert [p for p, _ in results] == paths
    kinds = [type(r).__name__ for _, r in results]
    assert kinds == ["Caption", "Caption", "ImageError", "Caption"]
    assert all(r.path == p for p, r in results if not isinstance(r, ImageError))
    with pytest.raises(ImageError, match="im1_corrupt.jpg"):
        captioner.caption(paths)


# --- CLI -------------------------------------------------------------------------------------


def test_cli_caption_a_folder_with_a_corrupt_image(checkpoint, folder, capsys):
    code = main(["caption", str(folder), "--checkpoint", str(checkpoint), "--beam", "2", "--max-length", "5",
                 "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code != 0
    lines = out.splitlines()
    assert [line.split("\t")[0] for line in lines] == [str(folder / f"im{i}.png") for i in range(3)]
    assert all(line.split("\t")[1] for line in lines)
    errors = [line for line in err.splitlines() if line.startswith("captioner: error:")]
    assert errors == [errors[0]] and f"captioner: error: {folder / 'im1_corrupt.jpg'}: " in errors[0]


def test_cli_caption_json_and_globs(checkpoint, folder, capsys):
    code = main(["caption", str(folder / "im*.png"), "--checkpoint", str(checkpoint), "--json", "--beam", "3",
                 "--device", "cpu"])
    out, _ = capsys.readouterr()
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert set(row) >= {"path", "caption", "tokens", "score", "attention"}
        att = np.array(row["attention"])
        assert att.shape == (len(row["tokens"]), 4, 4)  # words x rows x cols
        np.testing.assert_allclose(att.sum(axis=(1, 2)), 1.0, atol=1e-6)


def test_cli_evaluate_on_shapes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CAPTIONER_CACHE", str(tmp_path / "cache"))
    ckpt = _save(tmp_path / "m.pt", data=DataConfig(path="shapes", shapes_images=30))
    out_json = tmp_path / "results.json"
    code = main(["evaluate", "--checkpoint", str(ckpt), "--data", "shapes", "--split", "test", "--out", str(out_json),
                 "--beam", "2", "--no-meteor", "--device", "cpu"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "CIDEr-D" in out and "Bleu_4" in out and "METEOR" in out and "grounding (generated captions)" in out
    assert "grounding (teacher-forced on the reference captions)" in out
    report = json.loads(out_json.read_text())
    assert report["images"] == 3 and report["split"] == "test" and report["grounding"] is not None
    refs = {c["path"]: c["references"] for c in report["captions"]}
    hyps = {c["path"]: c["caption"] for c in report["captions"]}
    assert report["metrics"] == pytest.approx(caption_metrics(refs, hyps, meteor=False))
    assert 0.0 <= report["grounding"]["all"]["hit_rate"] <= 1.0
    forced = report["reference_grounding"]["all"]
    assert forced["words"] >= 3 * 5 and 0.0 <= forced["hit_rate"] <= 1.0  # every reference names its shapes
    assert "attention: a word's peak weight is a median" in out
    assert "objects:  none of the 3 captions names one of COCO's 80 object kinds" in out  # circles, not things
    assert report["hallucination"]["references"]["captions"] == 3 * 5
    assert report["focus"]["peak_median"] >= 1.0 and 0.0 <= report["focus"]["focused"] <= 1.0


def test_cli_evaluate_reports_an_empty_split(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CAPTIONER_CACHE", str(tmp_path / "cache"))
    data = tmp_path / "captions.txt"
    (tmp_path / "Images").mkdir()
    for i in range(12):
        _image(i, (16, 16)).save(tmp_path / "Images" / f"{i}.jpg")
    data.write_text("image,caption\n" + "".join(f"{i}.jpg,a red circle\n" for i in range(12)))  # train/val only
    code = main(["evaluate", "--checkpoint", str(_save(tmp_path / "m.pt")), "--data", str(data), "--device", "cpu"])
    assert code == 2 and "no images in split 'test'" in capsys.readouterr().err


def test_a_pil_image_is_captioned_exactly_as_its_file(checkpoint, tmp_path):
    """An EXIF-rotated photo: the API upright-rotates an opened image just as it does the path."""
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    _image(5, (90, 40)).save(tmp_path / "rotated.jpg", exif=exif, quality=95)
    captioner = Captioner.from_checkpoint(checkpoint, device="cpu")
    (from_path,) = captioner.caption([tmp_path / "rotated.jpg"], beam_size=2)
    (from_memory,) = captioner.caption([PIL.Image.open(tmp_path / "rotated.jpg")], beam_size=2)
    assert from_memory.image_size == from_path.image_size == (40, 90)
    assert from_memory.text == from_path.text and from_memory.score == pytest.approx(from_path.score)
    np.testing.assert_allclose(from_memory.attention, from_path.attention)


def test_an_ensemble_of_a_model_with_itself_captions_as_the_model(checkpoint):
    alone = Captioner.from_checkpoint(checkpoint, device="cpu").caption([_image(i) for i in range(3)], beam_size=3)
    twice = Captioner.from_checkpoint([checkpoint, checkpoint], device="cpu").caption([_image(i) for i in range(3)],
                                                                                      beam_size=3)
    assert [c.text for c in twice] == [c.text for c in alone]
    np.testing.assert_allclose([c.score for c in twice], [c.score for c in alone], atol=1e-5)
    np.testing.assert_allclose(twice[0].attention, alone[0].attention, atol=1e-6)


@torch.no_grad()
def test_an_ensemble_step_is_the_mean_of_its_members_distributions(tmp_path):
    from captioner.decoding.ensemble import EnsembleDecoder

    a, b = (Captioner.from_checkpoint(_save(tmp_path / f"{n}.pt"), device="cpu").model for n in "ab")
    torch.manual_seed(1)
    for p in b.decoder.parameters():
        p.add_(torch.randn_like(p) * 0.3)  # another model of the same shape
    ensemble = EnsembleDecoder([a.decoder, b.decoder])
    features = a.encoder(torch.rand(2, 3, 64, 64))
    tokens = torch.tensor([1, 5])
    memory = ensemble.memory(features)
    out = ensemble.step(tokens, ensemble.init_hidden(memory), memory)

    def alone(decoder):
        memory = decoder.memory(features)
        return torch.softmax(decoder.step(tokens, decoder.init_hidden(memory), memory).logits, -1)

    torch.testing.assert_close(out.logits.exp(), (alone(a.decoder) + alone(b.decoder)) / 2)


def test_averaged_checkpoints_hold_the_mean_weights(tmp_path, capsys):
    from captioner.model.checkpoint import load_checkpoint

    a, b = _save(tmp_path / "a.pt"), tmp_path / "b.pt"
    ckpt = load_checkpoint(a)
    state_b = {k: v.clone() for k, v in ckpt.model_state.items()}
    state_b["decoder.readout.bias"] += 2.0  # a later checkpoint of the same run
    save_checkpoint(b, ckpt.config, ckpt.vocab, state_b)
    assert main(["average", str(a), str(b), "-o", str(tmp_path / "avg.pt")]) == 0
    avg = load_checkpoint(tmp_path / "avg.pt").model_state
    first = load_checkpoint(a).model_state
    torch.testing.assert_close(avg["decoder.readout.bias"], first["decoder.readout.bias"] + 1.0)
    torch.testing.assert_close(avg["decoder.embedding.weight"], first["decoder.embedding.weight"])


def test_cli_evaluate_with_a_box_file(tmp_path, monkeypatch, capsys):
    """`--boxes FILE` scores the pointing game on the photos the file names (here: the shapes test
    images, boxed by hand as a user would), on generated and on reference captions; with
    `--relevance`, the gradient relevance maps of the same words too, labelled apart."""
    from captioner.data.sources import load_records

    monkeypatch.setenv("CAPTIONER_CACHE", str(tmp_path / "cache"))
    data = DataConfig(path="shapes", shapes_images=30)
    ckpt = _save(tmp_path / "m.pt", data=data)
    test = [r for r in load_records(data) if r.split == "test"]
    boxes = tmp_path / "boxes.jsonl"
    boxes.write_text("".join(json.dumps({"image": r.image.name, "objects": [
        {"words": b.label.split()[-1:], "boxes": [[b.x0, b.y0, b.x1, b.y1]]} for b in r.boxes]}) + "\n" for r in test))
    out_json = tmp_path / "results.json"
    code = main(["evaluate", "--checkpoint", str(ckpt), "--split", "test", "--boxes", str(boxes), "--out",
                 str(out_json), "--beam", "2", "--no-meteor", "--device", "cpu", "--relevance"])
    out, _ = capsys.readouterr()
    assert code == 0 and "centre" in out and "even" in out
    assert "grounding (gradient relevance, not attention: the reference captions)" in out
    report = json.loads(out_json.read_text())
    forced = report["reference_grounding"]
    shape_words = sum(1 for r in test for c in r.captions for w in c.split() if w in {"circle", "square", "triangle"})
    assert forced["all"]["words"] == shape_words  # only the shape names are boxed now, not the colours
    assert set(forced["by_word"]) <= {"circle", "square", "triangle"}
    assert set(forced["all"]) == {"words", "hit_rate", "mean_mass", "centre_hit_rate", "even_mass"}
    relevance = report["relevance"]
    assert relevance["reference"]["all"]["words"] == shape_words
    assert relevance["generated"]["all"]["words"] == report["grounding"]["all"]["words"]
    assert relevance["reference"]["all"]["mean_mass"] != forced["all"]["mean_mass"]  # other maps, same words


def test_cli_evaluate_relevance_needs_boxes_and_the_torch_decoder(tmp_path, capsys, checkpoint):
    for extra, message in ((["--relevance"], "give --boxes FILE too"),
                           (["--relevance", "--boxes", "b.jsonl", "--runtime", "onnx"], "use --runtime torch")):
        assert main(["evaluate", "--checkpoint", str(checkpoint), "--device", "cpu", *extra]) != 0
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1


def test_cli_evaluate_refuses_a_bad_box_file_before_captioning(tmp_path, capsys, checkpoint):
    bad = tmp_path / "boxes.jsonl"
    bad.write_text('{"image": "a.jpg", "objects": [{"words": ["dog"], "boxes": [[1, 2]]}]}\n')
    code = main(["evaluate", "--checkpoint", str(checkpoint), "--boxes", str(bad), "--device", "cpu"])
    _, err = capsys.readouterr()
    assert code != 0 and "boxes.jsonl:1: a box must be" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command, takes", [("caption", True), ("evaluate", True), ("visualize", False),
                                            ("serve", False)])
def test_batch_size_is_an_option_only_where_many_images_are_captioned(command, takes, capsys):
    from captioner.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._subparsers._group_actions if a.dest == "command").choices[command]
    assert any("--batch-size" in a.option_strings for a in sub._actions) == takes


@pytest.mark.parametrize("decode", [DecodeConfig(), DecodeConfig(beam_size=3, no_repeat_ngram=2, no_repeat_words=True),
                                    DecodeConfig(beam_size=1, max_length=9, length_penalty=0.5)])
def test_decode_flags_give_back_the_settings_they_were_made_from(decode):
    """scripts/flickr8k.py hands the config's decode settings to `evaluate` and `export` as flags."""
    from captioner.cli import build_parser
    from captioner.cli.common import decode_flags, decode_overrides

    args = build_parser().parse_args(["evaluate", "--checkpoint", "run/best.pt", *decode_flags(decode)])
    assert decode.with_overrides(**decode_overrides(args)) == decode
    assert DecodeConfig().with_overrides(**decode_overrides(args)) == decode
