import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.config import Config, DecodeConfig, DecoderConfig, EncoderConfig, ModelConfig
from captioner.data.shapes import make_example
from captioner.data.vocab import Vocabulary
from captioner.decoding.captioner import Captioner
from captioner.model import build_model
from captioner.model.checkpoint import CheckpointError, load_checkpoint, restore_model, save_checkpoint
from captioner.recipes.train import run_config, train

V1 = Path(__file__).parent / "fixtures" / "v1"  # a last.pt written by captioner 0.1 (checkpoint version 1)
CFG = ModelConfig(
    encoder=EncoderConfig(name="random", image_size=64),
    decoder=DecoderConfig(embed_dim=8, hidden_dim=16, attention_dim=8, dropout=0.0),
)
VOCAB = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "a", "red", "circle"])


def _restored(path):
    """The checkpoint's model in eval mode, and the checkpoint."""
    ckpt = load_checkpoint(path)
    return restore_model(ckpt, path).eval(), ckpt


def _saved(tmp_path):
    model = build_model(CFG, len(VOCAB)).eval()
    path = save_checkpoint(tmp_path / "run" / "model.pt", Config(model=CFG, decode=DecodeConfig(beam_size=2)), VOCAB,
                           model.state_dict(), meta={"note": "x"})
    return model, path


def test_round_trip_gives_identical_outputs(tmp_path):
    model, path = _saved(tmp_path)
    images = torch.rand(2, 3, 64, 64)
    tokens = torch.tensor([[1, 4, 5, 6, 2], [1, 5, 2, 0, 0]])
    loaded, ckpt = _restored(path)
    assert ckpt.model_config == CFG and ckpt.vocab == VOCAB and ckpt.meta == {"note": "x"}
    assert ckpt.config.decode.beam_size == 2
    with torch.no_grad():
        lengths = torch.tensor([4, 2])
        expected, got = model(images, tokens, lengths), loaded(images, tokens, lengths)
    assert torch.equal(expected.logits, got.logits) and torch.equal(expected.alphas, got.alphas)
    # Atomic write leaves no temporary files behind.
    assert [p.name for p in path.parent.iterdir()] == ["model.pt"]


def _one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_not_a_checkpoint(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"this is not a checkpoint at all")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(junk)
    _one_line(e, "junk.pt", "not a readable checkpoint")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "absent.pt")
    _one_line(e, "absent.pt", "not found")


def test_foreign_torch_file(tmp_path):
    foreign = tmp_path / "resnet.pt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, foreign)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(foreign)
    _one_line(e, "resnet.pt", "not a captioner checkpoint")


def test_checkpoint_that_does_not_fit_the_code(tmp_path):
    _, path = _saved(tmp_path)
    payload = torch.load(path, weights_only=True)
    payload["config"]["model"]["decoder"]["heads"] = 8  # a key this code does not know
    torch.save(payload, tmp_path / "newer.pt")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "newer.pt")
    _one_line(e, "newer.pt", "heads")

    payload = torch.load(path, weights_only=True)
    payload["model"]["decoder.readout.weight"] = torch.zeros(3, 3)  # wrong shape
    torch.save(payload, tmp_path / "mismatch.pt")
    with pytest.raises(CheckpointError) as e:
        _restored(tmp_path / "mismatch.pt")
    _one_line(e, "mismatch.pt", "readout")


def test_the_run_config_is_stored_once(tmp_path):
    _, path = _saved(tmp_path)
    payload = torch.load(path, weights_only=True)
    assert payload["version"] == 3 and set(payload["config"]) == {"data", "model", "train", "decode"}
    assert "model_config" not in payload and "config" not in payload["meta"]


def test_a_version_1_checkpoint_loads_and_captions_as_it_did(caplog):
    """tests/fixtures/v1/last.pt was trained by captioner 0.1 (config keys alpha_reg and entropy_reg,
    the run config in train_state); expected.json holds what 0.1 captioned with it."""
    ckpt = load_checkpoint(V1 / "last.pt")
    assert ckpt.train_state is not None and "config" not in ckpt.train_state
    # alpha_reg 0.1 summed over the 16 regions of the random encoder's 4x4 grid = a mean weighted 1.6
    assert ckpt.config.train.coverage_weight == pytest.approx(1.6) and ckpt.config.train.entropy_weight == 0.01
    assert "alpha_reg" in caplog.text
    assert ckpt.config.decode == DecodeConfig(beam_size=2, max_length=12, length_penalty=0.7)

    captioner = Captioner.from_checkpoint(V1 / "last.pt", "cpu")
    expected = json.loads((V1 / "expected.json").read_text())
    images = [make_example(i, 0)[0] for i in (8, 9, 18)]  # the shapes images it was run on (seed 0, 224 px)
    for beam in (1, 2):
        got = captioner.caption(images, beam_size=beam)
        want = [e for e in expected if e["beam"] == beam]
        assert [c.text for c in got] == [e["caption"] for e in want]
        np.testing.assert_allclose([c.score for c in got], [e["score"] for e in want], atol=1e-4)
        np.testing.assert_allclose(np.array([c.attention[0] for c in got]), [e["attention0"] for e in want], atol=1e-5)


def test_a_version_1_run_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPTIONER_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(V1 / "last.pt", run / "last.pt")
    cfg = run_config(None, ["train.epochs=7"], resume=run / "last.pt")
    result = train(cfg, run, "cpu", resume=run / "last.pt")
    assert (result.epochs, result.steps) == (7, 70)  # 6 epochs of 10 steps were done
    assert load_checkpoint(result.last).train_state["position"]["epoch"] == 7


def test_a_checkpoint_with_nan_weights_is_refused(tmp_path):
    model, _ = _saved(tmp_path)
    state = model.state_dict()
    state["decoder.readout.bias"][3] = float("nan")
    path = save_checkpoint(tmp_path / "diverged.pt", Config(model=CFG), VOCAB, state)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    _one_line(e, "diverged.pt", "NaN", "decoder.readout.bias")


def test_a_truncated_checkpoint_is_reported_as_truncated(tmp_path):
    _, path = _saved(tmp_path)
    data = path.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(cut)
    _one_line(e, "cut.pt", "truncated")
    assert "not a PyTorch file" not in str(e.value)


def test_a_crafted_pickle_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil.pt"
    torch.save({"format": "captioner", "version": 2, "model": Payload()}, evil)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(evil)
    _one_line(e, "evil.pt", "refused", "may contain code", "not loaded")
    assert "weights_only" not in str(e.value) and "\x1b" not in str(e.value)
    assert not marker.exists()


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KB tmpfs when this machine lets the test mount one (root on Linux); else None."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], capture_output=True).returncode:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_leaves_the_previous_checkpoint_loadable(tmp_path, tiny_disk, monkeypatch):
    model = build_model(CFG, len(VOCAB))
    small = {k: v for k, v in model.state_dict().items() if k.startswith("decoder.embedding")}
    folder = tiny_disk or tmp_path
    previous = save_checkpoint(folder / "last.pt", Config(model=CFG), VOCAB, small)
    before = previous.read_bytes()
    big = {**small, "padding": torch.zeros(200_000)}  # 800 KB: does not fit on the 256 KB disk
    if tiny_disk is None:  # no tmpfs here: the writer fails as a full disk does
        real_open = os.fdopen

        def full_disk(fd, mode="r", *args, **kwargs):
            f = real_open(fd, mode, *args, **kwargs)
            if "w" in mode:
                def write(data):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                f.write = write
            return f

        monkeypatch.setattr(os, "fdopen", full_disk)
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(folder / "last.pt", Config(model=CFG), VOCAB, big)
    _one_line(e, "last.pt", "No space left on device", "unchanged")
    monkeypatch.undo()
    assert previous.read_bytes() == before and load_checkpoint(previous).vocab == VOCAB
    assert [p.name for p in folder.iterdir()] == ["last.pt"]  # no temporary file left behind


GROUPED_VOCAB = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "a", "man", "dog", "person", "woman", "grass"])


def test_a_new_runs_detector_reads_the_words_its_training_groups_and_the_checkpoint_keeps_that(tmp_path):
    """`train.concept_groups`: "man" and "woman" read the "person" output; the slots are saved with the
    weights, so a model fine-tuned from this one (self-critical training, whose own config does not
    group) reads its detector the same way."""
    from captioner.config import TrainConfig
    from captioner.model.concepts import concept_slots
    from captioner.recipes.build import build_run_model

    model_cfg = ModelConfig(encoder=CFG.encoder, decoder=DecoderConfig(embed_dim=8, hidden_dim=16, attention_dim=8,
                                                                       concepts=True))
    cfg = Config(model=model_cfg, train=TrainConfig(concept_groups=True))
    model = build_run_model(cfg, GROUPED_VOCAB, None, None, None)
    person = GROUPED_VOCAB.id("person")
    assert model.decoder.detector_slots[GROUPED_VOCAB.id("man")] == person
    assert torch.equal(model.decoder.detector_slots, concept_slots(GROUPED_VOCAB, grouped=True))
    path = save_checkpoint(tmp_path / "xent.pt", cfg, GROUPED_VOCAB, model.state_dict())
    ckpt = load_checkpoint(path)
    scst = Config(model=model_cfg, train=TrainConfig(objective="scst", init=str(path)))  # concept_groups False
    tuned = build_run_model(scst, GROUPED_VOCAB, None, ckpt, None)
    assert torch.equal(tuned.decoder.detector_slots, model.decoder.detector_slots)


def test_a_cross_entropy_run_from_a_grouped_model_trains_the_outputs_its_decoding_reads(tmp_path):
    """The grouping is the model's: a cross-entropy run `--init`ed from a grouped model trains "woman" on
    the person output whatever its own `train.concept_groups` says, as decoding will read it (and a new
    ungrouped model trains each word's own)."""
    from captioner.config import TrainConfig
    from captioner.data.datasets import CaptionDataset
    from captioner.data.records import Record
    from captioner.recipes.build import Data, build_objective, build_run_model
    from captioner.training.distributed import DistInfo

    model_cfg = ModelConfig(encoder=CFG.encoder, decoder=DecoderConfig(embed_dim=8, hidden_dim=16, attention_dim=8,
                                                                       concepts=True))
    grouped = Config(model=model_cfg, train=TrainConfig(concept_groups=True, concept_weight=1.0))
    path = save_checkpoint(tmp_path / "grouped.pt", grouped, GROUPED_VOCAB,
                           build_run_model(grouped, GROUPED_VOCAB, None, None, None).state_dict())
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    captions = CaptionDataset([Record(tmp_path / "a.png", ("a woman on grass",), "train")], GROUPED_VOCAB,
                              transform=lambda image: image)
    data = Data(captions, captions, None, cached=True)

    def trained_slots(cfg, init):
        model = build_run_model(cfg, GROUPED_VOCAB, None, init, None)
        objective, _, _ = build_objective(cfg, model, data, GROUPED_VOCAB, init, torch.device("cpu"), DistInfo(), None)
        assert torch.equal(objective.criterion.slots, model.decoder.detector_slots)
        return objective.criterion.slots

    person, woman = GROUPED_VOCAB.id("person"), GROUPED_VOCAB.id("woman")
    ungrouped = TrainConfig(concept_weight=1.0, init=str(path))  # concept_groups False
    assert trained_slots(Config(model=model_cfg, train=ungrouped), load_checkpoint(path))[woman] == person
    new = Config(model=model_cfg, train=TrainConfig(concept_weight=1.0))
    assert trained_slots(new, None)[woman] == woman


@pytest.mark.parametrize("grouped", [True, False])
def test_a_version_2_checkpoint_gets_its_detectors_word_outputs_from_the_weights(tmp_path, grouped):
    """Version 2 did not save the slots: a grouped detector never trained its grouped words' own outputs
    (their bias still the initial -6 exactly), whatever the run's config said."""
    from captioner.config import to_dict
    from captioner.model.concepts import concept_slots

    model_cfg = ModelConfig(encoder=CFG.encoder, decoder=DecoderConfig(embed_dim=8, hidden_dim=16, attention_dim=8,
                                                                       concepts=True))
    slots = concept_slots(GROUPED_VOCAB, grouped)
    model = build_model(model_cfg, len(GROUPED_VOCAB))
    state = model.state_dict()
    trained = torch.isin(torch.arange(len(GROUPED_VOCAB)), slots)  # the outputs some word reads
    state["decoder.concepts.bias"][trained] += 0.01 * torch.randn(int(trained.sum()))
    del state["decoder.detector_slots"]
    path = tmp_path / "v2.pt"
    torch.save({"format": "captioner", "version": 2, "config": to_dict(Config(model=model_cfg)),
                "vocab": GROUPED_VOCAB.to_list(), "model": state, "train_state": None, "meta": {}}, path)
    restored, _ = _restored(path)
    assert torch.equal(restored.decoder.detector_slots, slots)


@pytest.mark.parametrize("part, value, words", [
    ("model", [1, 2], ["'model' is not a state dict"]),
    ("model", {"decoder.readout.bias": 3}, ["'model' is not a state dict"]),
    ("config", "model: x", ["'config' is a str, not a mapping"]),
    ("meta", "note", ["'meta' is a str, not a mapping"]),
    ("train_state", [1], ["'train_state' is a list, not a mapping"]),
    ("vocab", 7, ["vocabulary must be a list of words"]),
    ("vocab", ["<pad>", "<start>", "<end>", "<unk>", 5], ["vocabulary entry 4"]),
    ("config", None, ["lacks config"]),
    ("model", None, ["lacks model"]),
])
def test_a_marked_checkpoint_with_a_malformed_part_is_one_line_naming_the_file(tmp_path, part, value, words):
    _, path = _saved(tmp_path)
    payload = torch.load(path, weights_only=True)
    payload[part] = value
    if value is None:
        del payload[part]
    torch.save(payload, tmp_path / "malformed.pt")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "malformed.pt")
    _one_line(e, "malformed.pt", *words)


def test_an_export_folder_given_as_a_checkpoint_says_to_run_it_with_onnx(tmp_path, capsys):
    from PIL import Image

    from captioner.cli import main

    folder = tmp_path / "exported"
    folder.mkdir()
    (folder / "manifest.json").write_text("{}")
    Image.new("RGB", (8, 8)).save(tmp_path / "photo.png")
    for argv in (["caption", str(tmp_path / "photo.png"), "--checkpoint", str(folder)],
                 ["evaluate", "--checkpoint", str(folder), "--no-meteor"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and f"{folder}: an exported model folder" in err and "--runtime onnx" in err, err


def test_averaging_refuses_weights_that_differ_or_do_not_fit_naming_the_files(tmp_path, capsys):
    from captioner.cli import main

    model, good = _saved(tmp_path)
    state = model.state_dict()
    del state["decoder.readout.bias"]
    lacking = save_checkpoint(tmp_path / "lacking.pt", Config(model=CFG), VOCAB, state)
    lacking2 = save_checkpoint(tmp_path / "lacking2.pt", Config(model=CFG), VOCAB, state)
    out = tmp_path / "avg.pt"
    for inputs, words in (((good, lacking), ["lacking.pt: other weights than", "model.pt", "decoder.readout.bias"]),
                          ((lacking, lacking2), ["lacking.pt: weights do not fit", "decoder.readout.bias"])):
        assert main(["average", *map(str, inputs), "-o", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and all(w in err for w in words), err
        assert not out.exists()


def test_an_ensemble_that_does_not_fit_names_both_files_in_evaluate(tmp_path, capsys):
    from captioner.cli import main

    _, first = _saved(tmp_path)
    other_vocab = Vocabulary([*VOCAB.to_list(), "square"])
    other = save_checkpoint(tmp_path / "other.pt", Config(model=CFG), other_vocab,
                            build_model(CFG, len(other_vocab)).state_dict())
    assert main(["evaluate", "--checkpoint", str(first), str(other), "--no-meteor"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{other}: another encoder or vocabulary than {first}" in err, err
