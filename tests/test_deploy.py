"""ONNX export and ONNX Runtime inference: the same captions, scores and maps as torch; one-line errors."""
import builtins
import dataclasses
import json
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from captioner.cli import main
from captioner.config import Config, DecodeConfig, DecoderConfig, EncoderConfig, ModelConfig
from captioner.data.images import full_size, load_image
from captioner.data.vocab import build_vocabulary
from captioner.decoding.captioner import Captioner
from captioner.deploy import FormatError
from captioner.model import build_model
from captioner.model.checkpoint import load_checkpoint, save_checkpoint

pytest.importorskip("onnxruntime", reason="the onnx extra is not installed (pip install -e .[dev])")
from captioner.deploy.export import export_onnx  # noqa: E402
from captioner.deploy.runtime import onnx_captioner  # noqa: E402

from exports import CAPTIONS, exported_once, random_images, tiny_checkpoint  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared/data/flickr8k-800/Images"


def test_onnx_runtime_captions_exactly_as_torch(each_exported):
    checkpoint, report = each_exported
    detects = "words.onnx" in {p.name for p in report.files}
    assert {p.name for p in report.files} == {"encoder.onnx", "memory.onnx", "step.onnx", "manifest.json",
                                              *(["words.onnx"] if detects else [])}
    assert max(report.differences.values()) < 1e-4
    settings = {"detector_weight": 2.0} if detects else {}  # the word detector weighed in, on both runtimes
    torch_captions = Captioner.from_checkpoint(checkpoint, device="cpu").caption(random_images(), alternatives=2,
                                                                                 **settings)
    onnx_captions = onnx_captioner(report.folder).caption(random_images(), alternatives=2, **settings)
    for t, o in zip(torch_captions, onnx_captions):
        assert o.tokens == t.tokens and o.finished == t.finished and o.image_size == t.image_size
        assert o.score == pytest.approx(t.score, abs=1e-4) and o.cells == t.cells
        np.testing.assert_allclose(o.attention, t.attention, atol=1e-4)
        assert [a.tokens for a in o.alternatives] == [a.tokens for a in t.alternatives]


def test_onnx_runtime_forces_a_given_caption_as_torch(each_exported, tmp_path, capsys):
    """`caption(text=)` drives the exported step graph through teacher forcing: the same word
    log-probabilities and maps as the torch decoder; `--text` works with `--runtime onnx`."""
    checkpoint, report = each_exported
    text = "a blue square to the left of a red circle"
    torch_captions = Captioner.from_checkpoint(checkpoint, device="cpu").caption(random_images(3), text=text)
    onnx_captions = onnx_captioner(report.folder).caption(random_images(3), text=text)
    for t, o in zip(torch_captions, onnx_captions):
        assert o.tokens == t.tokens == text.split() and o.finished
        np.testing.assert_allclose(o.word_logprobs, t.word_logprobs, atol=1e-4)
        assert o.logprob == pytest.approx(t.logprob, abs=1e-4) and o.score == pytest.approx(t.score, abs=1e-4)
        np.testing.assert_allclose(o.attention, t.attention, atol=1e-4)
    image = tmp_path / "photo.png"
    random_images(1)[0].save(image)
    assert main(["caption", str(image), "--checkpoint", str(report.folder), "--runtime", "onnx", "--text", text,
                 "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["tokens"] == text.split()
    np.testing.assert_allclose(row["word_logprobs"], torch_captions[0].word_logprobs, atol=1e-4)


def test_a_checkpoint_is_exported_once_into_the_cache(exported, monkeypatch, tmp_path):
    checkpoint, _ = exported
    monkeypatch.setenv("CAPTIONER_CACHE", str(tmp_path))
    first = onnx_captioner(checkpoint).caption(random_images(2))
    (folder,) = (tmp_path / "onnx").iterdir()
    stamp = (folder / "step.onnx").stat().st_mtime_ns
    second = onnx_captioner(checkpoint).caption(random_images(2))
    assert [c.tokens for c in first] == [c.tokens for c in second]
    assert (folder / "step.onnx").stat().st_mtime_ns == stamp


def test_cli_export_then_caption_with_the_onnx_runtime(exported, tmp_path, capsys):
    checkpoint, _ = exported
    image = tmp_path / "photo.png"
    random_images(1)[0].save(image)
    assert main(["export", "--checkpoint", str(checkpoint), "-o", str(tmp_path / "out")]) == 0
    assert "largest difference from torch" in capsys.readouterr().out
    assert main(["caption", str(image), "--checkpoint", str(tmp_path / "out"), "--runtime", "onnx", "--json"]) == 0
    onnx_row = json.loads(capsys.readouterr().out)
    assert main(["caption", str(image), "--checkpoint", str(checkpoint), "--json", "--device", "cpu"]) == 0
    torch_row = json.loads(capsys.readouterr().out)
    assert onnx_row["tokens"] == torch_row["tokens"]
    assert onnx_row["score"] == pytest.approx(torch_row["score"], abs=1e-4)


def test_an_export_records_the_decode_defaults_it_is_given(exported, tmp_path, capsys):
    """`export --beam 1 --length-penalty 0.5`: the manifest's decode defaults, which `caption` then
    uses with the export (here the greedy caption torch writes with --beam 1); the rest the checkpoint's.
    A bad value is refused before anything is written."""
    checkpoint, _ = exported
    image = tmp_path / "photo.png"
    random_images(1)[0].save(image)
    out = tmp_path / "greedy"
    assert main(["export", "--checkpoint", str(checkpoint), "-o", str(out), "--beam", "1",
                 "--length-penalty", "0.5"]) == 0
    capsys.readouterr()
    decode = json.loads((out / "manifest.json").read_text())["decode"]
    own = load_checkpoint(checkpoint).config.decode
    assert own.beam_size != 1
    assert decode == {**dataclasses.asdict(own), "beam_size": 1, "length_penalty": 0.5}
    assert main(["caption", str(image), "--checkpoint", str(out), "--runtime", "onnx", "--json"]) == 0
    onnx_row = json.loads(capsys.readouterr().out)
    assert main(["caption", str(image), "--checkpoint", str(checkpoint), "--json", "--device", "cpu",
                 "--beam", "1", "--length-penalty", "0.5"]) == 0
    assert onnx_row["tokens"] == json.loads(capsys.readouterr().out)["tokens"]
    assert main(["export", "--checkpoint", str(checkpoint), "-o", str(tmp_path / "bad"), "--beam", "0"]) == 2
    assert capsys.readouterr().err.strip().startswith("captioner: error: --beam")
    assert not (tmp_path / "bad").exists()


def test_a_missing_extra_is_one_line_naming_it(exported, monkeypatch, tmp_path, capsys):
    checkpoint, _ = exported
    real_import = builtins.__import__

    def no_onnxruntime(name, *args, **kwargs):
        if name == "onnxruntime":
            raise ImportError("No module named 'onnxruntime'", name="onnxruntime")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_onnxruntime)
    assert main(["export", "--checkpoint", str(checkpoint), "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("captioner: error: the ONNX runtime needs the 'onnx' extra: pip install 'captioner[onnx]' "
                   "(onnxruntime is not installed)")
    assert main(["caption", "x.png", "--checkpoint", str(checkpoint), "--runtime", "onnx"]) == 2
    assert "pip install 'captioner[onnx]'" in capsys.readouterr().err


def test_bad_export_folders_and_settings_are_one_line(exported, tmp_path):
    checkpoint, report = exported
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text((report.folder / "manifest.json").read_text())
    with pytest.raises(FormatError, match=r"broken: not an export folder .*encoder.onnx, memory.onnx, step.onnx missing"):
        onnx_captioner(broken)
    pooled = tiny_checkpoint(tmp_path / "pooled.pt", init_pooling="attention")
    with pytest.raises(FormatError, match="init_pooling 'attention' is not exported yet"):
        export_onnx(pooled, tmp_path / "pooled")


@pytest.mark.parametrize("key, value, words", [
    ("vocabulary", 5, ["vocabulary must be a list of words"]),
    ("decode", {"beam_size": 0}, ["'decode.beam_size': 0 is not allowed"]),
    ("decode", None, ["lacks decode"]),
    ("encoder", [], ["encoder is a list"]),
])
def test_a_manifest_without_what_running_reads_is_one_line_naming_it(exported, tmp_path, key, value, words):
    from captioner.deploy.folder import read_manifest
    from captioner.deploy.lite import lite_captioner

    _, report = exported
    folder = tmp_path / "mangled"
    folder.mkdir()
    for f in report.folder.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest[key] = value
    if value is None:
        del manifest[key]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    for read in (read_manifest, onnx_captioner, lite_captioner):
        with pytest.raises(FormatError) as e:
            read(folder)
        assert "\n" not in str(e.value) and str(e.value).startswith(f"{folder / 'manifest.json'}: ")
        assert all(w in str(e.value) for w in words), str(e.value)


def test_draft_decoding_keeps_the_photo_size_and_what_the_encoder_sees(tmp_path):
    """A large JPEG decoded at 1/4 scale (draft mode) then resized to the encoder's side, against the
    full decode resized: nearly the same pixels, and `full_size` is still the photo's."""
    rng = np.random.default_rng(1)
    small = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
    photo = PIL.Image.fromarray(small).resize((1600, 1200), PIL.Image.BICUBIC)  # smooth, like a photo
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # stored sideways
    path = tmp_path / "big.jpg"
    photo.save(path, quality=92, exif=exif)
    drafted, full = load_image(path, draft=256), load_image(path)
    assert full.size == full_size(full) == full_size(drafted) == (1200, 1600)  # upright
    assert drafted.size == (300, 400)  # 1/4 scale: both sides still >= 256
    a, b = (np.asarray(im.resize((256, 256), PIL.Image.BICUBIC), np.float32) for im in (drafted, full))
    assert np.abs(a - b).mean() < 2.0  # of 255


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"{SHARED} not present")
def test_draft_decoding_changes_little_on_real_photos(tmp_path):
    """Shared photos enlarged 4x (so that draft mode decodes them at 1/4): the encoder's grids of the
    draft and of the full decode agree (cosine similarity of every region)."""
    from captioner.model.encoder import build_encoder

    encoder = build_encoder(EncoderConfig(name="efficientnet_lite0", image_size=256)).eval()
    transform = encoder.transform()
    for i, source in enumerate(sorted(SHARED.glob("*.jpg"))[:4]):
        big = tmp_path / f"{i}.jpg"
        with PIL.Image.open(source) as im:
            im.convert("RGB").resize((im.width * 4, im.height * 4), PIL.Image.BICUBIC).save(big, quality=90)
        drafted, full = load_image(big, draft=256), load_image(big)
        assert drafted.width * 4 == full.width
        with torch.no_grad():
            grids = encoder(torch.stack([transform(drafted), transform(full)]))  # (2, L, D)
        assert torch.nn.functional.cosine_similarity(grids[0], grids[1], dim=-1).min() > 0.9


def test_manifest_holds_what_the_runtime_needs(exported):
    _, report = exported
    manifest = json.loads((report.folder / "manifest.json").read_text())
    assert manifest["encoder"]["grid"] == [4, 4] and manifest["vocabulary"][:4] == ["<pad>", "<start>", "<end>", "<unk>"]
    assert manifest["decode"] == dataclasses.asdict(DecodeConfig(beam_size=3, max_length=8))


def test_the_feature_cache_filled_by_onnx_runtime_matches_torch(tmp_path):
    from captioner.data.cache_build import build_cache
    from captioner.data.records import Record
    from captioner.deploy.cache_encoder import OnnxGridEncoder, cache_encoder
    from captioner.model.encoder import build_encoder

    encoder = build_encoder(EncoderConfig(name="random", image_size=64))
    assert cache_encoder(encoder, "cpu", "auto") is encoder  # the tiny test CNN stays in torch
    onnx_encoder = cache_encoder(encoder, "cpu", "onnx")
    assert isinstance(onnx_encoder, OnnxGridEncoder) and onnx_encoder.cache_key() == encoder.cache_key()
    records = []
    for i, image in enumerate(random_images(5)):
        image.save(tmp_path / f"{i}.png")
        records.append(Record(tmp_path / f"{i}.png", ["a caption"], "train"))
    by_torch = build_cache(records, encoder, tmp_path / "torch").cache
    by_onnx = build_cache(records, onnx_encoder, tmp_path / "onnx").cache
    for r in records:
        np.testing.assert_allclose(np.asarray(by_onnx.get(r.image)), np.asarray(by_torch.get(r.image)), atol=1e-4)


def _photos(folder: Path, n: int = 8) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"photo{i}.png" for i in range(n)]
    for image, path in zip(random_images(n), paths):
        image.save(path)
    return [str(p) for p in paths]


def test_an_int8_export_quantizes_the_encoder_and_captions_with_it(exported, tmp_path):
    import onnx

    checkpoint, fp32 = exported
    report = export_onnx(checkpoint, tmp_path / "int8", int8_calibration=_photos(tmp_path / "calibration"))
    ops = {node.op_type for node in onnx.load(str(report.folder / "encoder.onnx")).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops and "QuantizeLinear" not in {
        node.op_type for g in ("memory", "step") for node in onnx.load(str(report.folder / f"{g}.onnx")).graph.node}
    encoder = json.loads((report.folder / "manifest.json").read_text())["encoder"]
    assert encoder["precision"] == "int8" and encoder["calibration"]["images"] == 8
    assert 0 < report.encoder_difference < 0.5 and encoder["calibration"]["relative_difference"] == pytest.approx(
        report.encoder_difference, abs=1e-4)
    assert json.loads((fp32.folder / "manifest.json").read_text())["encoder"]["precision"] == "float32"
    captions = onnx_captioner(report.folder).caption(random_images(3))
    assert all(c.tokens and c.finished is not None for c in captions)
    for c in captions:
        assert c.attention.reshape(len(c.tokens), -1).sum(-1) == pytest.approx(np.ones(len(c.tokens)), abs=1e-4)


def test_a_float16_export_stores_the_encoder_weights_in_half_and_captions_as_float32(exported, tmp_path, capsys):
    import onnx

    checkpoint, fp32 = exported
    out = tmp_path / "half"
    assert main(["export", "--checkpoint", str(checkpoint), "-o", str(out), "--quantize", "float16"]) == 0
    assert "float16 encoder: its grids differ from float32 by" in capsys.readouterr().out
    large = {init.data_type for init in onnx.load(str(out / "encoder.onnx")).graph.initializer
             if np.prod(init.dims) >= 1024}  # every weight but the small vectors (norms, biases)
    assert large == {onnx.TensorProto.FLOAT16}
    encoder = json.loads((out / "manifest.json").read_text())["encoder"]
    assert encoder["encoder_weights"] == "float16" and 0 < encoder["relative_difference"] < 0.01
    assert encoder["precision"] == "float32"  # computed in float32: the weights are cast back when loaded
    for half, full in zip(onnx_captioner(out).caption(random_images()), onnx_captioner(fp32.folder).caption(random_images())):
        assert half.tokens == full.tokens
        np.testing.assert_allclose(half.attention, full.attention, atol=0.02)
    assert main(["export", "--checkpoint", str(checkpoint), "-o", str(tmp_path / "no"), "--quantize", "float16",
                 "--calibration", *_photos(tmp_path / "calibration", 1)]) == 2
    assert capsys.readouterr().err.strip() == ("captioner: error: --calibration is for --quantize int8: a float16 "
                                               "encoder needs no photos")


def test_a_two_scale_encoder_quantizes_to_int8(tmp_path_factory, tmp_path):
    """The two-scale grid's upsampling must be a graph ONNX Runtime's quantization tools can follow."""
    checkpoint, _ = exported_once(tmp_path_factory, "two-scale-grid")
    report = export_onnx(checkpoint, tmp_path / "int8", int8_calibration=_photos(tmp_path / "calibration"))
    (caption,) = onnx_captioner(report.folder).caption(random_images(1))
    assert 0 < report.encoder_difference < 0.5 and caption.attention.shape[1:] == (8, 8)


def test_an_int8_encoder_too_far_from_float32_is_refused_and_the_folder_left_as_it_was(exported, tmp_path, capsys,
                                                                                      monkeypatch):
    import shutil

    from captioner.deploy import quantize

    monkeypatch.setattr(quantize, "INT8_TOLERANCE", 1e-9)  # any int8 grid differs by more than this
    checkpoint, fp32 = exported
    out = tmp_path / "model"
    shutil.copytree(fp32.folder, out)  # a working export, to be replaced
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["export", "--checkpoint", str(checkpoint), "-o", str(out), "--quantize", "int8",
                 "--calibration", *_photos(tmp_path / "calibration", 2)]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "its int8 encoder differs from float32 by" in err
    assert "export without --quantize" in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing half-replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calibration", "model"]  # no staging folder left


def test_a_graph_onnx_runtime_cannot_quantize_is_one_line_and_the_folder_left_as_it_was(exported, tmp_path,
                                                                                          capsys, monkeypatch):
    """ONNX Runtime's quantization tools raise bare Exceptions ("Incomplete symbolic shape inference"
    for a graph whose shapes they cannot follow): one line, nothing replaced."""
    import shutil

    import onnxruntime.quantization.shape_inference as shape_inference

    def fail(*args, **kwargs):  # as ORT's symbolic shape inference does: its half-inferred graph into the cwd
        Path("sym_shape_infer_temp.onnx").write_bytes(b"graph")
        raise Exception("Incomplete symbolic shape inference")

    monkeypatch.setattr(shape_inference, "quant_pre_process", fail)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    checkpoint, fp32 = exported
    out = tmp_path / "model"
    shutil.copytree(fp32.folder, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["export", "--checkpoint", str(checkpoint), "-o", str(out), "--quantize", "int8",
                 "--calibration", *_photos(tmp_path / "calibration", 2)]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "could not be quantized to int8 (Incomplete symbolic shape inference)" in err
    assert "export without --quantize" in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert list(work.iterdir()) == []  # nothing left in the user's working directory


def test_int8_settings_are_checked_before_any_export(exported, tmp_path, capsys):
    checkpoint, _ = exported
    out = tmp_path / "out"
    assert main(["export", "--checkpoint", str(checkpoint), "-o", str(out), "--quantize", "int8"]) == 2
    assert capsys.readouterr().err.strip() == ("captioner: error: --quantize int8 and --calibration IMG go together: "
                                               "the int8 ranges are calibrated on photos")
    (tmp_path / "empty").mkdir()
    assert main(["export", "--checkpoint", str(checkpoint), "-o", str(out), "--quantize", "int8",
                 "--calibration", str(tmp_path / "empty")]) == 2
    assert "empty: no image files" in capsys.readouterr().err
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(b"not a jpeg")
    assert main(["export", "--checkpoint", str(checkpoint), "-o", str(out), "--quantize", "int8",
                 "--calibration", str(broken)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"captioner: error: {broken}: none of the 1 calibration images could be read"
    assert not (out / "encoder.onnx").exists()  # refused before minutes of export


def test_small_names_how_the_decoder_weights_are_stored(capsys):
    """`--small` alone is float16 (as before int8 came); `--small int8`; anything else is refused."""
    from captioner.cli import build_parser

    base = ["export", "--checkpoint", "model.pt", "-o", "out"]
    assert build_parser().parse_args(base).small is None
    assert build_parser().parse_args([*base, "--small"]).small == "float16"
    assert build_parser().parse_args([*base, "--small", "int8"]).small == "int8"
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args([*base, "--small", "int4"])
    assert refused.value.code == 2 and "--small: invalid choice: 'int4'" in capsys.readouterr().err


def test_evaluate_with_the_onnx_runtime_scores_as_torch(tmp_path, capsys):
    torch.manual_seed(0)
    model_cfg = ModelConfig(encoder=EncoderConfig(name="random", image_size=64),
                            decoder=DecoderConfig(embed_dim=16, hidden_dim=32, attention_dim=16, dropout=0.0))
    data = dataclasses.replace(Config().data, path="shapes", shapes_images=20, val_fraction=0.25)
    vocab = build_vocabulary(CAPTIONS)
    checkpoint = save_checkpoint(tmp_path / "tiny.pt", Config(data=data, model=model_cfg), vocab,
                                 build_model(model_cfg, len(vocab), pretrained=False).state_dict())
    scores = {}
    for runtime in ("torch", "onnx"):
        out = tmp_path / f"{runtime}.json"
        assert main(["evaluate", "--checkpoint", str(checkpoint), "--split", "val", "--no-meteor", "--runtime",
                     runtime, "--device", "cpu", "--out", str(out)]) == 0
        scores[runtime] = json.loads(out.read_text())
    capsys.readouterr()
    assert len(scores["onnx"]["captions"]) == len(scores["torch"]["captions"]) >= 2
    assert [c["caption"] for c in scores["onnx"]["captions"]] == [c["caption"] for c in scores["torch"]["captions"]]
    assert scores["onnx"]["metrics"] == pytest.approx(scores["torch"]["metrics"], abs=1e-6)


@pytest.mark.parametrize("precision, stored, most", [("float16", "FLOAT16", 0.6), ("int8", "INT8", 0.5)])
def test_a_small_export_stores_the_decoder_rounded_and_captions_as_its_rounded_weights(tmp_path, precision, stored,
                                                                                        most):
    """`export --small float16|int8`: no token tables, the decoder's weights rounded (int8: one scale
    per row) and stored so; its captions, scores and maps are those of the torch model with those
    rounded weights, and its decoder graphs are smaller than a full export's."""
    import onnx

    from captioner.deploy.weights import round_weights
    from captioner.model.checkpoint import load_checkpoint, restore_model

    checkpoint = tiny_checkpoint(tmp_path / "tiny.pt", attend="after", global_context=True, concepts=True)
    full = export_onnx(checkpoint, tmp_path / "full")
    small = export_onnx(checkpoint, tmp_path / "small", small=precision)
    assert max(small.differences.values()) < 1e-4
    full_size_, small_size = (sum((r.folder / f"{g}.onnx").stat().st_size for g in ("memory", "step"))
                              for r in (full, small))
    assert small_size < most * full_size_  # a tiny vocabulary: its tables are small (Flickr8k: 9.3 vs 42.6 MB)
    step = onnx.load(str(small.folder / "step.onnx"))
    assert any(i.data_type == getattr(onnx.TensorProto, stored) for i in step.graph.initializer)
    assert json.loads((small.folder / "manifest.json").read_text())["encoder"]["decoder_weights"] == precision
    ckpt = load_checkpoint(checkpoint)
    model = restore_model(ckpt, str(checkpoint))
    model.decoder = round_weights(model.decoder, precision)
    gru = model.decoder.cell.weight_ih.detach()
    assert torch.equal(gru, gru.half().float())  # the recurrent weights in float16 (int8: the others)
    rounded = Captioner(model, ckpt.vocab, ckpt.config.decode, "cpu")
    for t, o in zip(rounded.caption(random_images()), onnx_captioner(small.folder).caption(random_images())):
        assert o.tokens == t.tokens and o.score == pytest.approx(t.score, abs=1e-4)
        np.testing.assert_allclose(o.attention, t.attention, atol=1e-4)


def test_int8_weights_are_found_by_row_or_column_and_nothing_else_is_rounded():
    """A matrix `round_weights` made int8 is stored as int8 times one scale per row, also when the
    exporter stored it transposed, doubled or a slice of its columns (a GRU's weights split by input);
    a weight not so rounded is never quantized."""
    from captioner.deploy.weights import _int8_rows, as_int8

    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 40)[:, None]
    rounded = _int8_rows(w).numpy()
    assert np.abs(rounded - w.numpy()).max() <= np.abs(w.numpy()).max(axis=1).max() / 127 / 2 + 1e-6
    for seen in (rounded, rounded.T.copy(), 2 * rounded, rounded[:, 40:].T.copy()):
        q, scale = as_int8(seen)
        assert q.dtype == np.int8 and np.abs(q).max() <= 127 and scale.size == 40
        np.testing.assert_allclose(q * scale, seen, rtol=1e-6)
    assert as_int8(w.numpy()) is None
    assert as_int8(w.half().float().numpy()) is None


def test_the_detector_weight_needs_a_word_detector_and_a_weight_in_range(exported, tmp_path, capsys):
    """`--detector-weight` on a model without a word detector, on either runtime, or out of range: one line
    naming it and a non-zero exit, before any captioning."""
    checkpoint, report = exported  # a decoder without a word detector
    image = tmp_path / "photo.png"
    random_images(1)[0].save(image)
    for model in (["--checkpoint", str(checkpoint), "--device", "cpu"],
                  ["--checkpoint", str(report.folder), "--runtime", "onnx"]):
        assert main(["caption", str(image), *model, "--detector-weight", "0.5"]) != 0
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "--detector-weight" in err and "no word detector" in err
    assert main(["caption", str(image), "--checkpoint", str(checkpoint), "--detector-weight", "-1"]) == 2
    assert capsys.readouterr().err.strip().startswith("captioner: error: --detector-weight")


def test_int8_quantization_keeps_the_first_convolutions_float(tmp_path):
    """`quantize.FLOAT_CONVS`: the first convolutions (at most an eighth of a net's) read float32 weights; the
    rest int8 ones (through DequantizeLinear)."""
    import onnx

    from captioner.deploy.export import export_graph
    from captioner.deploy.quantize import quantize_encoder

    torch.manual_seed(0)
    net = torch.nn.Sequential(*(m for _ in range(16) for m in (torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.ReLU6())))
    net[0] = torch.nn.Conv2d(3, 4, 3, padding=1)
    export_graph(net, (torch.rand(1, 3, 16, 16),), ["pixels"], ["grid"], tmp_path / "fp32.onnx")
    quantize_encoder(tmp_path / "fp32.onnx", tmp_path / "int8.onnx", np.random.default_rng(0).random((4, 3, 16, 16),
                                                                                                   dtype=np.float32))
    graph = onnx.load(str(tmp_path / "int8.onnx")).graph
    made_by = {out: node.op_type for node in graph.node for out in node.output}
    weights = [made_by.get(node.input[1], "initializer") for node in graph.node if node.op_type == "Conv"]
    assert weights == ["initializer"] * 2 + ["DequantizeLinear"] * 14
