"""The ONNX runtime without torch (`deploy.lite`, `decoding.numpy_search`): the same pixels, searches,
captions, scores and maps as the torch-driven ONNX runtime; `captioner caption` with an export folder
or the bundled model never imports torch."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

from captioner.cli import main
from captioner.config import ConfigError, DecodeConfig, DecoderConfig
from captioner.data.vocab import build_vocabulary
from captioner.decoding import numpy_search
from captioner.decoding.rules import block_repeated_ngrams, block_repeated_words
from captioner.decoding.search import beam_search
from captioner.decoding.text import TextError
from captioner.deploy import FormatError
from captioner.model.decoder import AttentionDecoder
from captioner.model.encoder import eval_transform

pytest.importorskip("onnxruntime", reason="the onnx extra is not installed (pip install -e .[dev])")
from captioner.deploy.graphs import Preprocess  # noqa: E402
from captioner.deploy.lite import lite_captioner  # noqa: E402
from captioner.deploy.runtime import onnx_captioner  # noqa: E402

from exports import CAPTIONS, random_images  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "torchvision", "timm")
# `captioner ARGS` in this process's interpreter, reporting which heavy modules it imported; with
# BUNDLED set, that folder is the model bundled with the package.
RUNNER = """
import json, os, sys
from pathlib import Path
import captioner.deploy.folder
if os.environ.get("BUNDLED") is not None:
    captioner.deploy.folder.bundled_model = lambda: Path(os.environ["BUNDLED"]) if os.environ["BUNDLED"] else None
from captioner.cli import main
code = main(sys.argv[1:])
print(json.dumps([m for m in {heavy!r} if m in sys.modules]), file=sys.stderr)
sys.exit(code)
""".format(heavy=HEAVY)


def _cli(*args: str, bundled: Path | str | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", **({} if bundled is None else {"BUNDLED": str(bundled)})}
    return subprocess.run([sys.executable, "-c", RUNNER, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def _heavy_imported(result: subprocess.CompletedProcess) -> list[str]:
    return json.loads(result.stderr.strip().splitlines()[-1])


def _assert_same(lite, reference, atol=1e-5):
    assert lite.tokens == reference.tokens and lite.text == reference.text
    assert lite.finished == reference.finished and lite.image_size == reference.image_size
    assert lite.path == reference.path and lite.cells == reference.cells
    assert lite.score == pytest.approx(reference.score, abs=atol)
    assert lite.logprob == pytest.approx(reference.logprob, abs=atol)
    assert lite.attention.dtype == np.float32 and lite.attention.shape == reference.attention.shape
    np.testing.assert_allclose(lite.attention, reference.attention, atol=atol)


@pytest.mark.parametrize("settings", [
    {"beam_size": 1, "no_repeat_ngram": 2},
    {"beam_size": 3, "no_repeat_ngram": 2},
    {"beam_size": 3, "no_repeat_ngram": 1, "max_length": 3, "length_penalty": 0.0},
], ids=["greedy", "beam3", "beam3-short"])
def test_captions_scores_and_maps_equal_the_torch_driven_runtime(each_exported, settings):
    _, report = each_exported
    alternatives = settings["beam_size"] - 1
    if (report.folder / "words.onnx").is_file():  # the word detector weighed in, on both runtimes
        settings = {**settings, "detector_weight": 2.0}
    images = random_images(6)
    reference = onnx_captioner(report.folder).caption(images, batch_size=4, alternatives=alternatives, **settings)
    lite = lite_captioner(report.folder).caption(images, batch_size=4, alternatives=alternatives, **settings)
    assert len(lite) == len(reference) == 6
    assert len({c.score for c in reference}) > 1  # the images are told apart: a real comparison
    for got, want in zip(lite, reference):
        _assert_same(got, want)
        assert len(got.alternatives) == len(want.alternatives)
        for a, b in zip(got.alternatives, want.alternatives):
            _assert_same(a, b)


def test_files_skip_unreadable_ones_as_the_torch_driven_runtime_does(exported, tmp_path):
    _, report = exported
    paths = []
    for i, image in enumerate(random_images(5)):
        paths.append(tmp_path / f"{i}.png")
        image.save(paths[-1])
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    paths.insert(2, tmp_path / "broken.jpg")
    want = list(onnx_captioner(report.folder).caption_files(paths, batch_size=2, beam_size=3, no_repeat_ngram=2))
    got = list(lite_captioner(report.folder).caption_files(paths, batch_size=2, beam_size=3, no_repeat_ngram=2))
    assert [p for p, _ in got] == [p for p, _ in want] == [str(p) for p in paths]
    assert "broken.jpg: not an image" in str(got[2][1]) and str(got[2][1]) == str(want[2][1])
    for (_, g), (_, w) in zip(got[:2] + got[3:], want[:2] + want[3:]):
        _assert_same(g, w)


def test_preprocessed_pixels_equal_the_torch_transform(exported):
    """Pillow's resize is what torchvision runs on a PIL image, ToTensor and Normalize float32 steps:
    the pixels are the same, for any filter, size and mode."""
    rng = np.random.default_rng(1)
    photos = [PIL.Image.fromarray(rng.integers(0, 256, (37, 91, 3), dtype=np.uint8)),
              PIL.Image.fromarray(rng.integers(0, 256, (300, 200), dtype=np.uint8)),  # grayscale
              PIL.Image.fromarray(rng.integers(0, 256, (64, 64, 4), dtype=np.uint8), "RGBA")]
    from torchvision.transforms import InterpolationMode

    for interpolation, size in (("bicubic", 64), ("bilinear", 48), ("nearest", 32)):
        mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
        ours = Preprocess(size, interpolation, mean, std)
        theirs = eval_transform(size, InterpolationMode(interpolation), mean, std)
        for photo in photos:
            got = ours(photo)
            assert got.dtype == np.float32 and got.shape == (3, size, size)
            np.testing.assert_allclose(got, theirs(photo).numpy(), rtol=0, atol=1e-6)
    _, report = exported
    lite = lite_captioner(report.folder)
    torch_driven = onnx_captioner(report.folder)
    np.testing.assert_array_equal(lite.preprocess(photos[0]), torch_driven.preprocess(photos[0]).numpy())


def _decoder(vocab_size: int, attend: str) -> AttentionDecoder:
    torch.manual_seed(0)
    decoder = AttentionDecoder(vocab_size, 24, DecoderConfig(embed_dim=16, hidden_dim=32, attention_dim=16,
                                                             dropout=0.0, attend=attend), grid=(3, 3)).eval()
    with torch.no_grad():
        decoder.readout.weight.mul_(4.0)  # peaked word distributions: no near-ties
        decoder.readout.bias[2] += 1.0  # <end> now and then: finished and cut captions both
    return decoder


def _numpy_step(decoder: AttentionDecoder):
    from captioner.model.memory import Memory

    def step(tokens, state, features, keys):
        with torch.no_grad():
            out = decoder.step(torch.from_numpy(tokens), torch.from_numpy(state),
                               Memory(torch.from_numpy(features), torch.from_numpy(keys)))
        return out.logits.numpy(), out.alpha.numpy(), out.hidden.numpy()

    return step


@pytest.mark.parametrize("K, ngram, penalty, min_length, n_best", [
    (1, 0, 1.0, 1, 1), (2, 2, 1.0, 1, 2), (3, 1, 0.0, 0, 3), (4, 2, 2.0, 3, 2), (5, 3, 0.7, 1, 5)])
@pytest.mark.parametrize("attend", ["before", "after"])
@pytest.mark.parametrize("once_only", [False, True])
def test_the_numpy_search_equals_the_torch_search_on_one_decoder(K, ngram, penalty, min_length, n_best, attend,
                                                                 once_only):
    """Over the torch decoder itself, both searches: every setting, hypotheses in the same order."""
    vocab = build_vocabulary(CAPTIONS)
    decoder = _decoder(len(vocab), attend)
    grids = torch.randn(5, 9, 24, generator=torch.Generator().manual_seed(1))  # (B, L, D)
    options = dict(beam_size=K, max_length=6, start_id=vocab.start_id, end_id=vocab.end_id,
                   banned_ids=(vocab.pad_id, vocab.start_id, vocab.unk_id), length_penalty=penalty,
                   no_repeat_ngram=ngram, min_length=min_length, n_best=n_best, no_end_after=[vocab.id("a")],
                   once=vocab.content_ids() if once_only else ())
    want = beam_search(decoder, grids, **options)
    with torch.no_grad():
        memory = decoder.memory(grids)
        initial = decoder.init_hidden(memory)
    got = numpy_search.beam_search(_numpy_step(decoder), memory.features.numpy(), memory.keys.numpy(),
                                   initial.numpy(), **options)
    assert any(h.finished for hyps in want for h in hyps)
    for g_hyps, w_hyps in zip(got, want, strict=True):
        assert [h.tokens for h in g_hyps] == [h.tokens for h in w_hyps]
        for g, w in zip(g_hyps, w_hyps):
            assert g.finished == w.finished and g.score == pytest.approx(w.score, abs=1e-5)
            np.testing.assert_allclose(g.alphas, w.alphas.numpy(), atol=1e-6)


def test_ngram_blocking_equals_the_torch_blocking():
    rng = np.random.default_rng(0)
    words = rng.integers(0, 5, (6, 9))  # (R, t): few words, many repeats
    logp = rng.standard_normal((6, 5)).astype(np.float32)
    for n in (1, 2, 3, 9, 10):
        got = numpy_search.block_repeated_ngrams(logp.copy(), words, n)
        want = block_repeated_ngrams(torch.from_numpy(logp.copy()), torch.from_numpy(words), n).numpy()
        np.testing.assert_array_equal(got, want)
    assert np.isinf(numpy_search.block_repeated_ngrams(logp.copy(), words, 2)).sum() > 0


def test_word_blocking_equals_the_torch_blocking():
    rng = np.random.default_rng(0)
    words = rng.integers(0, 8, (6, 5))  # (R, t)
    logp = rng.standard_normal((6, 8)).astype(np.float32)
    once = np.array([False, True, True, False, True, False, False, True])  # (V,)
    got = numpy_search.block_repeated_words(logp.copy(), words, once)
    want = block_repeated_words(torch.from_numpy(logp.copy()), torch.from_numpy(words), torch.from_numpy(once))
    np.testing.assert_array_equal(got, want.numpy())
    assert 0 < np.isinf(got).sum() < got.size


def test_the_cli_captions_an_export_without_importing_torch(exported, tmp_path):
    _, report = exported
    image = tmp_path / "photo.png"
    random_images(1)[0].save(image)
    out = _cli("caption", str(image), "--runtime", "onnx", "--checkpoint", str(report.folder), "--json",
               "--beam", "3", "--no-repeat-ngram", "2")
    assert out.returncode == 0, out.stderr
    assert _heavy_imported(out) == []
    row = json.loads(out.stdout)
    (want,) = onnx_captioner(report.folder).caption([str(image)], beam_size=3, no_repeat_ngram=2)
    assert row["tokens"] == want.tokens and row["path"] == str(image)
    assert row["score"] == pytest.approx(want.score, abs=1e-5)
    np.testing.assert_allclose(row["attention"], want.attention, atol=1e-5)


def test_no_checkpoint_uses_the_bundled_model_and_else_says_to_pass_one(exported, tmp_path):
    _, report = exported
    image = tmp_path / "photo.png"
    random_images(1)[0].save(image)
    bundled = _cli("caption", str(image), bundled=report.folder)
    assert bundled.returncode == 0, bundled.stderr
    assert _heavy_imported(bundled) == []
    given = _cli("caption", str(image), "--runtime", "onnx", "--checkpoint", str(report.folder))
    assert bundled.stdout == given.stdout and bundled.stdout.startswith(f"{image}\t")
    none = _cli("caption", str(image), bundled="")
    assert none.returncode == 2 and none.stdout == ""
    (error, _) = none.stderr.strip().splitlines()
    assert error.startswith("captioner: error: no model given and none bundled") and "pass --checkpoint" in error


def test_visualize_without_a_checkpoint_draws_the_bundled_models_maps(exported, tmp_path):
    """`captioner visualize photo -o out.png` with no --checkpoint draws the bundled model's caption
    (the one `caption` prints) and its maps; --relevance, which needs the torch decoder's gradients,
    is refused in one line before anything loads."""
    _, report = exported
    image = tmp_path / "photo.png"
    random_images(1)[0].save(image)
    picture = tmp_path / "maps.png"
    drawn = _cli("visualize", str(image), "-o", str(picture), bundled=report.folder)
    assert drawn.returncode == 0, drawn.stderr
    caption = _cli("caption", str(image), bundled=report.folder)
    assert drawn.stdout.splitlines()[0] == caption.stdout.strip() and picture.stat().st_size > 0
    refused = _cli("visualize", str(image), "-o", str(tmp_path / "r.png"), "--relevance", bundled=report.folder)
    assert refused.returncode == 2 and not (tmp_path / "r.png").exists()
    (error, _) = refused.stderr.strip().splitlines()
    assert error.startswith("captioner: error: --relevance needs the decoder's gradients: use --checkpoint CKPT")


def test_a_damaged_export_is_one_line(exported, tmp_path):
    _, report = exported
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for name in ("encoder.onnx", "memory.onnx", "step.onnx"):
        (damaged / name).write_bytes((report.folder / name).read_bytes())
    manifest = json.loads((report.folder / "manifest.json").read_text())
    del manifest["encoder"]["grid"]
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FormatError, match=r"damaged: manifest.json lacks or mangles .*KeyError: 'grid'"):
        lite_captioner(damaged)
    (damaged / "manifest.json").write_text((report.folder / "manifest.json").read_text())
    (damaged / "step.onnx").write_bytes(b"garbage")
    random_images(1)[0].save(tmp_path / "photo.png")
    out = _cli("caption", str(tmp_path / "photo.png"), "--runtime", "onnx", "--checkpoint", str(damaged))
    assert out.returncode == 2 and out.stdout == ""
    (error, _) = out.stderr.strip().splitlines()
    assert error.startswith(f"captioner: error: {damaged / 'step.onnx'}: not a usable ONNX graph")


def test_a_given_text_is_forced_as_the_torch_driven_runtime_forces_it(each_exported, tmp_path):
    _, report = each_exported
    images, text = random_images(4), "a red circle to the left of a blue square"
    want = onnx_captioner(report.folder).caption(images, batch_size=3, text=text, length_penalty=0.5)
    got = lite_captioner(report.folder).caption(images, batch_size=3, text=text, length_penalty=0.5)
    assert len({c.logprob for c in want}) == 4  # each image scores the words its own way
    for g, w in zip(got, want):
        _assert_same(g, w)
        assert g.alternatives == [] and g.word_logprobs == pytest.approx(w.word_logprobs, abs=1e-5)
    image = tmp_path / "photo.png"
    images[0].save(image)
    out = _cli("caption", str(image), "--runtime", "onnx", "--checkpoint", str(report.folder), "--text", text,
               "--json")
    assert out.returncode == 0, out.stderr
    assert _heavy_imported(out) == []
    assert json.loads(out.stdout)["word_logprobs"] == pytest.approx(got[0].word_logprobs, abs=1e-5)


def test_bad_texts_and_settings_are_refused_as_the_captioner_refuses_them(exported):
    _, report = exported
    lite = lite_captioner(report.folder)
    with pytest.raises(TextError, match=r"^text: 'zebra' not in the model's vocabulary"):
        lite.caption(random_images(1), text="a red zebra")
    with pytest.raises(ValueError, match="a caption given as text has none"):
        lite.caption(random_images(1), text="a red circle", alternatives=1)
    with pytest.raises(TypeError, match="unknown decode setting"):
        lite.caption(random_images(1), beam=3)
    with pytest.raises(ValueError, match="alternatives 3"):
        lite.caption(random_images(1), alternatives=3, beam_size=3)
    with pytest.raises(ConfigError, match="no word detector"):
        lite.caption(random_images(1), detector_weight=1.0)
    assert lite.decode == DecodeConfig(beam_size=3, max_length=8)


def test_visualize_runs_on_the_lite_runtime(exported, tmp_path, capsys):
    _, report = exported
    image = tmp_path / "photo.png"
    random_images(1)[0].save(image)
    assert main(["visualize", str(image), "--runtime", "onnx", "--checkpoint", str(report.folder),
                 "-o", str(tmp_path / "map.png")]) == 0
    (line, _) = capsys.readouterr().out.splitlines()[:2]
    (want,) = onnx_captioner(report.folder).caption([str(image)])
    assert line == f"{image}\t{want.text}" and (tmp_path / "map.png").stat().st_size > 0


def test_serve_without_a_checkpoint_serves_the_bundled_model_on_the_lite_runtime(exported, tmp_path):
    import re
    import urllib.request

    _, report = exported
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "BUNDLED": str(report.folder)}
    server = subprocess.Popen([sys.executable, "-c", RUNNER, "serve", "--port", "0"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = server.stdout.readline()
        found = re.search(r"serving (\S+) at (http://\S+/)", line)
        assert found, line + server.stdout.read()
        assert found.group(1) == str(report.folder)
        photo = tmp_path / "photo.png"
        random_images(1)[0].save(photo)
        request = urllib.request.Request(f"{found.group(2)}api/caption?beam=3", data=photo.read_bytes(),
                                         headers={"Content-Type": "image/png"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        info = json.loads(urllib.request.urlopen(f"{found.group(2)}api/model", timeout=60).read())
    finally:
        server.send_signal(2)
        server.wait(timeout=60)
    (want,) = lite_captioner(report.folder).caption([str(photo)], beam_size=3)
    assert answer["tokens"] == want.tokens and answer["score"] == pytest.approx(want.score, abs=1e-6)
    np.testing.assert_allclose(answer["attention"], want.attention, atol=1e-6)
    assert info["checkpoint"] == str(report.folder) and info["grid"] == [4, 4]
