"""Long runs a user can trust: a bad setting fails before any work, a run folder is never lost, Ctrl-C
and SIGTERM stop at a checkpoint that resumes exactly, a resume refuses other data, and what a user
can cause ends in one line, never a traceback."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.cli import main
from captioner.config import LIMITS, Config, load_config
from captioner.errors import CaptionerError
from captioner.model.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
TINY = """\
data: {path: shapes, shapes_images: 40}
model:
  encoder: {name: random, image_size: 64}
  decoder: {embed_dim: 16, hidden_dim: 32, attention_dim: 16, dropout: 0.2, feature_dim: 16}
train: {epochs: 3, batch_size: 16, lr: 0.005, patience: 0, amp: "off"}
decode: {beam_size: 2, max_length: 12}
"""


@pytest.fixture
def tiny(tmp_path, single_process):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


def _one_line_error(capsys, *words: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("captioner: error:") and "\n" not in err and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


# --- fail before the work --------------------------------------------------------------------


def _bad(spec: str, kind: type) -> object:
    """A value just outside a LIMITS range."""
    if spec.startswith(">="):
        value = float(spec[2:]) - 1
    elif spec.startswith(">"):
        value = float(spec[1:])
    else:
        hi = float(spec[1:-1].split(",")[1])
        value = hi + 1 if spec.endswith("]") else hi
    return int(value) if kind is int else value


def _bad_settings() -> list[tuple[str, object]]:
    """Every checked key with a value it refuses: each range of LIMITS, each Literal choice."""
    out, sections = [], {f.name: f.type for f in dataclasses.fields(Config)}
    hints = {name: typing.get_type_hints(cls) for name, cls in (("data", Config().data.__class__),
                                                                ("model.encoder", Config().model.encoder.__class__),
                                                                ("model.decoder", Config().model.decoder.__class__),
                                                                ("train", Config().train.__class__),
                                                                ("decode", Config().decode.__class__))}
    assert set(sections) == {"data", "model", "train", "decode"}
    for section, limits in LIMITS.items():
        for key, spec in limits.items():
            out.append((f"{section}.{key}", _bad(spec, hints[section][key])))
    for section, fields in hints.items():
        out += [(f"{section}.{key}", "nonsense") for key, tp in fields.items() if typing.get_origin(tp) is typing.Literal]
    return out


@pytest.mark.parametrize("key, value", _bad_settings(), ids=lambda v: str(v))
def test_a_bad_value_fails_at_once_naming_the_key_with_no_data_read(key, value, tiny, tmp_path, capsys, monkeypatch):
    def no_data(*args, **kwargs):
        raise AssertionError("data was read")

    monkeypatch.setattr("captioner.recipes.build.load_records", no_data)
    monkeypatch.setattr("captioner.recipes.train.build_encoder", no_data)
    tick = time.perf_counter()
    assert main(["train", "--config", str(tiny), "--out", str(tmp_path / "run"), f"{key}={value}"]) == 2
    assert time.perf_counter() - tick < 1.0
    _one_line_error(capsys, f"'{key}'", repr(value) if isinstance(value, str) else str(value), "not allowed")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, words", [
    (["data.val_fraction=0.6", "data.test_fraction=0.5"], ["data.val_fraction", "below 1"]),
    (["data.augment=true"], ["data.augment", "use_cache"]),
    (["train.amp=fp16"], ["fp16", "CUDA"]),
    (["train.val_metric=METEOR"], ["METEOR", "Java"]),
])
def test_combinations_and_the_machine_are_checked_before_any_data(overrides, words, tiny, tmp_path, capsys,
                                                                  monkeypatch):
    monkeypatch.setattr("captioner.recipes.build.java_available", lambda: False)
    monkeypatch.setattr("captioner.recipes.build.load_records", lambda *a, **k: pytest.fail("data was read"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert main(["train", "--config", str(tiny), "--out", str(tmp_path / "run"), *overrides, "--device", "cpu"]) == 2
    _one_line_error(capsys, *words)


def test_config_files_that_cannot_be_read_name_the_file_and_line(tmp_path, capsys):
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("train:\n  epochs: 3\n# caf\xe9\n".encode("latin-1"))
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  epochs: 3\n  lr: [1, 2\ndecode: {}\n")
    for path, words in ((latin, ["latin.yaml:3:", "not UTF-8"]), (tmp_path, ["is a folder"]),
                        (broken, ["broken.yaml:4:", "not valid YAML"])):
        assert main(["train", "--config", str(path), "--out", str(tmp_path / "run")]) == 2
        _one_line_error(capsys, *words)
    assert load_config(None, ["train.amp=off"]).train.amp == "off"  # YAML reads an unquoted off as false


def test_output_paths_are_checked_before_the_work(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setattr("captioner.recipes.evaluate.evaluate_checkpoint", lambda *a, **k: pytest.fail("worked"))
    monkeypatch.setattr("captioner.decoding.captioner.Captioner.from_checkpoint", lambda *a, **k: pytest.fail("worked"))
    image = tmp_path / "x.png"
    Image.new("RGB", (8, 8)).save(image)
    for argv in (["evaluate", "--checkpoint", "m.pt", "--out", str(blocker / "report.json")],
                 ["visualize", str(image), "--checkpoint", "m.pt", "-o", str(blocker / "p.png")],
                 ["visualize", str(image), "--checkpoint", "m.pt", "-o", str(tmp_path / "p.png"),
                  "--gif", str(tmp_path)],
                 ["visualize", str(image), "--checkpoint", "m.pt", "-o", str(tmp_path / "p.png"),
                  "--per-word", str(blocker)]):
        assert main(argv) == 2
        _one_line_error(capsys, str(blocker) if str(blocker) in " ".join(argv) else str(tmp_path))
    assert main(["train", "--config", "shapes", "--out", str(blocker)]) == 2
    _one_line_error(capsys, "a-file", "not a run folder")


# --- never lose a run ------------------------------------------------------------------------


def test_a_second_run_into_the_same_folder_is_refused_and_a_failed_one_loses_nothing(tiny, tmp_path, capsys,
                                                                                      monkeypatch):
    run = tmp_path / "run"
    assert main(["train", "--config", str(tiny), "--out", str(run), "--device", "cpu"]) == 0
    before = {name: (run / name).read_bytes() for name in ("best.pt", "last.pt", "metrics.jsonl", "config.yaml")}
    capsys.readouterr()
    assert main(["train", "--config", str(tiny), "--out", str(run), "--device", "cpu"]) == 2
    _one_line_error(capsys, str(run), "--resume", "last.pt", "--overwrite")
    # replacing it, but the new run fails at its 5th step, before its first checkpoint: the old run stays whole
    from captioner.training.objective import CrossEntropy

    step, steps = CrossEntropy.loss, []

    def failing_step(*args, **kwargs):
        steps.append(1)
        if len(steps) == 5:
            raise OSError(28, "No space left on device", str(run / "scratch"))
        return step(*args, **kwargs)

    monkeypatch.setattr(CrossEntropy, "loss", failing_step)
    assert main(["train", "--config", str(tiny), "--out", str(run), "--overwrite", "--device", "cpu"]) == 2
    _one_line_error(capsys, "No space left on device")
    assert {name: (run / name).read_bytes() for name in before} == before
    monkeypatch.undo()
    # replaced for real: the new run's files only
    assert main(["train", "--config", str(tiny), "--out", str(run), "--overwrite", "--device", "cpu",
                 "train.epochs=1"]) == 0
    assert [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()] == [10]
    assert load_checkpoint(run / "best.pt").config.train.epochs == 1


def _train_process(config: Path, out: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "captioner.cli", "train", "--config", str(config), "--out", str(out), "--device",
           "cpu", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert proc.poll() is None, proc.communicate()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The weights of a 6-epoch run nothing interrupted (the reference for the resumed ones)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    (tmp / "tiny.yaml").write_text(TINY)
    proc = _train_process(tmp / "tiny.yaml", tmp / "run", "train.epochs=6")
    assert proc.wait() == 0, proc.communicate()
    return load_checkpoint(tmp / "run" / "last.pt").model_state


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_epoch_stops_at_a_checkpoint_that_resumes_exactly(sig, tiny, tmp_path, uninterrupted):
    out = tmp_path / "run"
    proc = _train_process(tiny, out, "train.epochs=6")
    _wait_for(out / "metrics.jsonl", proc)  # the first epoch is done: the signal lands in a later one
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stderr[-2000:]
    assert "Traceback" not in stderr and f"resume with: captioner train --resume {out / 'last.pt'}" in stdout
    step = load_checkpoint(out / "last.pt").train_state["position"]["step"]
    assert 10 < step < 60 and f"after step {step}" in stdout

    assert main(["train", "--resume", str(out / "last.pt"), "--device", "cpu"]) == 0
    resumed = load_checkpoint(out / "last.pt").model_state
    assert all(torch.equal(resumed[k], v) for k, v in uninterrupted.items())


def test_a_second_ctrl_c_stops_at_once_and_keeps_the_previous_checkpoint(tiny, tmp_path):
    out = tmp_path / "run"
    proc = _train_process(tiny, out, "train.epochs=6", "train.checkpoint_every_steps=1")
    _wait_for(out / "last.pt", proc)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
    assert load_checkpoint(out / "last.pt").train_state is not None
    assert not list(out.glob(".*.tmp"))


# --- resuming other data ---------------------------------------------------------------------


def _flickr(folder: Path, captions: list[str]) -> Path:
    (folder / "Images").mkdir(parents=True, exist_ok=True)
    rows = ["image,caption"]
    for i in range(20):
        Image.fromarray(np.random.default_rng(i).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(
            folder / "Images" / f"{i}.png")
        rows += [f"{i}.png,{captions[i % len(captions)]}"] * 2
    (folder / "captions.txt").write_text("\n".join(rows) + "\n")
    return folder


def test_resuming_with_other_data_is_refused_saying_what_differs(tiny, tmp_path, capsys):
    data = _flickr(tmp_path / "data", ["a red circle", "a blue square"])
    run = tmp_path / "run"
    assert main(["train", "--config", str(tiny), "--data", str(data), "--out", str(run), "--device", "cpu",
                 "data.val_fraction=0.2", "train.epochs=1"]) == 0
    capsys.readouterr()
    _flickr(data, ["a red circle", "a green triangle"])  # new words
    assert main(["train", "--resume", str(run / "last.pt"), "train.epochs=2", "--device", "cpu"]) == 2
    _one_line_error(capsys, "vocabulary", "new: green", "gone: blue")
    _flickr(data, ["a blue square", "a red circle"])  # the same words on other images
    assert main(["train", "--resume", str(run / "last.pt"), "train.epochs=2", "--device", "cpu"]) == 2
    _one_line_error(capsys, "training data differ")


def test_images_elsewhere_need_image_root_and_a_run_that_misses_most_stops_in_setup(tiny, tmp_path, capsys):
    data = _flickr(tmp_path / "data", ["a red circle", "a blue square"])
    (data / "Images").rename(tmp_path / "photos")
    argv = ["train", "--config", str(tiny), "--data", str(data), "--out", str(tmp_path / "run"), "--device", "cpu",
            "data.val_fraction=0.2", "train.epochs=1"]
    assert main(argv) == 2
    _one_line_error(capsys, "20 of 20 images are missing", str(data / "Images" / "0.png"), "--image-root")
    assert main([*argv, "--image-root", str(tmp_path / "photos")]) == 0


# --- what users cause ends in one line -------------------------------------------------------


def test_a_closed_pipe_ends_quietly(tmp_path):
    from captioner.config import DecoderConfig, EncoderConfig, ModelConfig
    from captioner.data.vocab import build_vocabulary
    from captioner.model import build_model
    from captioner.model.checkpoint import save_checkpoint

    cfg = ModelConfig(EncoderConfig(name="random", image_size=64), DecoderConfig(16, 32, 16, 0.0, feature_dim=16))
    vocab = build_vocabulary(["a red circle"])
    ckpt = save_checkpoint(tmp_path / "m.pt", Config(model=cfg), vocab, build_model(cfg, len(vocab)).state_dict())
    for i in range(40):
        Image.new("RGB", (16, 16), (i, 0, 0)).save(tmp_path / f"{i:02d}.png")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "captioner.cli", "caption", str(tmp_path), "--checkpoint", str(ckpt),
           "--batch-size", "1", "--device", "cpu"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().startswith(str(tmp_path))  # like `| head -1`
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait() == 141 and stderr == "", stderr


def test_atomic_writes_get_the_usual_permissions(tmp_path):
    """A file written atomically is readable by others as open() would make it (mkstemp alone: 0600),
    so an exported model folder installed for everyone can be read by everyone."""
    import os
    import stat

    from captioner.files import atomic_write_text

    umask = os.umask(0o022)
    try:
        path = atomic_write_text(tmp_path / "manifest.json", "{}")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_full_disk_names_the_file_and_keeps_what_was_there(tmp_path, monkeypatch):
    """The system's ENOSPC names no file: the writer names it, the earlier file stays whole and no
    temporary is left behind."""
    import errno

    from captioner.files import atomic_write_text

    target = atomic_write_text(tmp_path / "report.json", "earlier")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as e:
        atomic_write_text(target, "later")
    assert (e.value.errno, e.value.filename) == (errno.ENOSPC, str(target))
    assert target.read_text() == "earlier" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_captions_printed_to_a_full_disk_end_in_one_line(tmp_path):
    photo = tmp_path / "x.png"
    Image.new("RGB", (64, 48), (200, 30, 30)).save(photo)
    with open("/dev/full", "w") as full:  # the bundled model captions it
        proc = subprocess.run([sys.executable, "-m", "captioner.cli", "caption", str(photo)], stdout=full,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "captioner: error: standard output: No space left on device\n"


def test_an_output_that_is_a_pipe_or_an_input_is_refused_before_the_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("captioner.decoding.captioner.Captioner.from_checkpoint", lambda *a, **k: pytest.fail("worked"))
    image = tmp_path / "x.png"
    Image.new("RGB", (8, 8)).save(image)
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    assert main(["visualize", str(image), "--checkpoint", "m.pt", "-o", str(pipe)]) == 2
    _one_line_error(capsys, str(pipe), "not a regular file")
    assert pipe.is_fifo()
    assert main(["visualize", str(image), "--checkpoint", "m.pt", "-o", str(image)]) == 2
    _one_line_error(capsys, str(image), "one of the command's inputs")
    assert image.stat().st_size > 0 and Image.open(image).size == (8, 8)


def test_a_run_never_writes_over_the_config_it_reads(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("captioner.recipes.train.train", lambda *a, **k: pytest.fail("trained"))
    config = tmp_path / "exp" / "config.yaml"
    config.parent.mkdir()
    config.write_text("# my notes\n" + TINY)
    assert main(["train", "--config", str(config), "--out", str(config.parent)]) == 2
    _one_line_error(capsys, str(config), "another --out")
    assert config.read_text().startswith("# my notes")


def test_prepare_refuses_an_empty_encoder_batch_before_reading_data(capsys, monkeypatch):
    monkeypatch.setattr("captioner.recipes.prepare.prepare", lambda *a, **k: pytest.fail("prepared"))
    assert main(["prepare", "--data", "shapes", "--batch-size", "0"]) == 2
    _one_line_error(capsys, "--batch-size", "0")


def test_the_demo_checks_its_photo_folder_before_training_and_passes_over_a_bad_photo(tmp_path, capsys,
                                                                                      monkeypatch, caplog):
    from captioner.recipes.demo import sample_photos

    monkeypatch.setattr("captioner.recipes.demo.train", lambda *a, **k: pytest.fail("trained"))
    assert main(["demo", "--out", str(tmp_path / "demo"), "--photos", str(tmp_path / "nowhere")]) == 2
    _one_line_error(capsys, "nowhere", "not there")
    with pytest.raises(CaptionerError, match="no photos in this folder"):
        sample_photos(tmp_path)
    (tmp_path / "a.jpg").write_text("not a photo")
    (tmp_path / "notes.txt").write_text("not a photo either, and not read as one")
    Image.new("RGB", (32, 24)).save(tmp_path / "b.jpg")
    Image.new("RGB", (32, 24)).save(tmp_path / "c.PNG")  # any image suffix, any case
    photos = sample_photos(tmp_path)
    assert [p.name for p in photos[1:]] == ["b.jpg", "c.PNG"]
    assert "a.jpg: not an image" in caplog.text and "notes.txt" not in caplog.text
