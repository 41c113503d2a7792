"""Training: a short run learns and leaves usable checkpoints; a killed run resumes to the very same
weights; the data order covers every caption once; bad configs fail in one line."""
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from captioner.cli import main
from captioner.config import ConfigError, DecodeConfig
from captioner.data.order import SeededItems, epoch_batches, steps_per_epoch
from captioner.decoding.search import decode
from captioner.model.checkpoint import load_checkpoint, restore_model
from captioner.model.encoder import build_encoder
from captioner.recipes.train import run_config, train
from captioner.training.distributed import capture_rng, restore_rng
from captioner.training.objective import sampling_probability
from captioner.training.optim import lr_factor
from captioner.training.state import Meter

ROOT = Path(__file__).resolve().parents[1]

TINY = """\
data:
  path: shapes
  shapes_images: 40
model:
  encoder: {name: random, image_size: 64}
  decoder: {embed_dim: 16, hidden_dim: 32, attention_dim: 16, dropout: 0.2}
train:
  epochs: 3
  batch_size: 16
  lr: 0.005
  scheduled_sampling: 0.3
  patience: 0
  amp: "off"  # pinned: "auto" would test bf16 on CPUs that have it and float32 on the others
decode: {beam_size: 2, max_length: 12}
"""


def _restored(path):
    """The checkpoint's model in eval mode, and the checkpoint."""
    ckpt = load_checkpoint(path)
    return restore_model(ckpt, path).eval(), ckpt


@pytest.fixture(scope="module")
def shapes_cache(tmp_path_factory):
    """A shared folder for the 40-image shapes set (generated once for the module)."""
    return tmp_path_factory.mktemp("captioner-cache")


@pytest.fixture
def tiny(tmp_path, shapes_cache, monkeypatch, single_process):
    """A tiny config file, trained in one process on one CPU thread."""
    monkeypatch.setenv("CAPTIONER_CACHE", str(shapes_cache))
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path


def _weights(path):
    return load_checkpoint(path).model_state


def _assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_short_run_lowers_the_loss_and_its_checkpoint_captions(tiny, tmp_path):
    result = train(run_config(tiny, []), tmp_path / "run", "cpu")
    lines = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [10, 20, 30] and result.steps == 30 and result.epochs == 3
    assert lines[-1]["loss"] < lines[0]["loss"]
    for key in ("xent", "coverage", "val_CIDEr", "val_Bleu_4", "val_chair_i", "val_chair_s", "lr", "seconds",
                "captions_per_s"):
        assert key in lines[0]
    assert result.best is not None and result.best.is_file() and result.last.is_file()

    model, ckpt = _restored(result.best)
    assert ckpt.train_state is None and ckpt.meta["best"]["metric"] == "CIDEr"
    last = load_checkpoint(result.last)
    assert last.train_state["position"]["epoch"] == 3 and last.config.train.epochs == 3
    features = model.encoder(torch.randn(2, 3, 64, 64))  # (2, L, D)
    hyps = decode(model.decoder, features, DecodeConfig(beam_size=2, max_length=8), ckpt.vocab)
    assert len(hyps) == 2 and all(len(h.tokens) >= 1 for h in hyps)


def test_killed_run_resumes_to_the_same_weights(tiny, tmp_path):
    """SIGKILL a training process at an arbitrary step; `--resume` must end where an uninterrupted run ends."""
    reference = train(run_config(tiny, []), tmp_path / "reference", "cpu")

    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "captioner.cli", "train", "--config", str(tiny), "--out", str(out), "--device", "cpu",
           "train.checkpoint_every_steps=1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (out / "last.pt").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)  # let it get into the next steps: the kill lands mid-step or mid-write
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    killed_at = load_checkpoint(out / "last.pt").train_state["position"]["step"]
    assert 1 <= killed_at < reference.steps, killed_at
    print(f"killed after step {killed_at} of {reference.steps}")

    assert main(["train", "--resume", str(out / "last.pt"), "--device", "cpu"]) == 0
    _assert_same_weights(_weights(reference.last), _weights(out / "last.pt"))
    _assert_same_weights(_weights(reference.best), _weights(out / "best.pt"))
    steps = [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [10, 20, 30]  # lines a killed run wrote after its checkpoint are not repeated


def test_stop_mid_epoch_then_resume_matches_a_full_run_and_overrides_extend_it(tiny, tmp_path):
    """The in-process stop hook at a mid-epoch step, with validation every 7 steps; then a finished run
    extended by `train.epochs=4`. Batches of similar lengths (`train.group_by_length`) resume exactly too."""
    overrides = ["model.decoder.init_pooling=attention", "train.val_every_steps=7", "train.group_by_image=false",
                 "train.group_by_length=true"]
    cfg = run_config(tiny, overrides)
    stopped = train(cfg, tmp_path / "run", "cpu", stop_after_steps=13)
    assert stopped.steps == 13
    train_state = load_checkpoint(tmp_path / "run" / "last.pt").train_state
    state = train_state["position"]
    assert (state["epoch"], state["batch"], state["step"]) == (1, 3, 13)
    assert train_state["data_order"]["group_by_length"] and not train_state["data_order"]["group_by_image"]
    last = tmp_path / "run" / "last.pt"
    resumed = train(run_config(None, [], resume=last), tmp_path / "run", "cpu", resume=last)
    full = train(cfg, tmp_path / "full", "cpu")
    assert resumed.steps == full.steps == 30
    _assert_same_weights(_weights(full.last), _weights(resumed.last))
    lines = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [7, 14, 21, 28, 30]  # and a last validation at the end

    extended = train(run_config(None, ["train.epochs=4"], resume=last), tmp_path / "run", "cpu", resume=last)
    assert (extended.epochs, extended.steps) == (4, 40)


def test_kept_validations_average_into_a_checkpoint_that_captions(tiny, tmp_path, capsys):
    """`train.keep_validated`: the model of every validation stays as step-NNNNNNN.pt, best.pt is one
    of them, and `captioner average` makes one checkpoint of their mean weights."""
    result = train(run_config(tiny, ["train.epochs=2", "train.keep_validated=true"]), tmp_path / "run", "cpu")
    kept = sorted((tmp_path / "run").glob("step-*.pt"))
    steps = [json.loads(ln)["step"] for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [p.name for p in kept] == [f"step-{s:07d}.pt" for s in steps] == ["step-0000010.pt", "step-0000020.pt"]
    assert all(load_checkpoint(p).train_state is None for p in kept)
    _assert_same_weights(_weights(result.best), _weights(kept[steps.index(result.best_step)]))

    out = tmp_path / "averaged.pt"
    assert main(["average", *map(str, kept), "-o", str(out)]) == 0
    assert "averaged 2 checkpoints" in capsys.readouterr().out
    first, second, averaged = _weights(kept[0]), _weights(kept[1]), _weights(out)
    assert averaged.keys() == first.keys()
    for k, v in averaged.items():
        if v.is_floating_point():
            torch.testing.assert_close(v, (first[k] + second[k]) / 2)
    assert not torch.equal(averaged["decoder.readout.bias"], first["decoder.readout.bias"])  # the runs' weights moved
    model, ckpt = _restored(out)
    assert ckpt.meta["averaged"] == [str(p) for p in kept] and ckpt.vocab == load_checkpoint(kept[0]).vocab
    hyps = decode(model.decoder, model.encoder(torch.randn(2, 3, 64, 64)), DecodeConfig(beam_size=2, max_length=8),
                  ckpt.vocab)
    assert len(hyps) == 2 and all(h.tokens for h in hyps)


def test_fine_tuned_encoder_trains_from_images(tiny, tmp_path):
    """No cache: the encoder runs on every batch, its last stage trains with its own lr, the rest stays put."""
    cfg = run_config(tiny, ["train.epochs=1", "data.augment=true", "model.encoder.trainable_stages=1",
                            "train.encoder_lr=0.01", "train.val_images=2"])
    result = train(cfg, tmp_path / "run", "cpu")
    assert not (tmp_path / "run" / "cache").exists()
    ckpt = load_checkpoint(result.last)
    groups = ckpt.train_state["optimizer"]["param_groups"]
    assert [g["initial_lr"] for g in groups] == [0.005, 0.01]
    fresh = build_encoder(cfg.model.encoder).state_dict()  # the random backbone's fixed initial weights
    after = {k.removeprefix("encoder."): v for k, v in ckpt.model_state.items() if k.startswith("encoder.")}
    assert not torch.equal(after["backbone.block3.0.weight"], fresh["backbone.block3.0.weight"])
    assert torch.equal(after["backbone.block0.0.weight"], fresh["backbone.block0.0.weight"])


def test_bad_config_key_is_one_line_and_exit_2(tiny, capsys):
    assert main(["train", "--config", str(tiny), "train.lrr=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "train.lrr" in err and err.startswith("captioner: error:")
    assert main(["train", "--config", str(tiny), "train.epochs=many"]) == 2
    assert "train.epochs" in capsys.readouterr().err


def test_encoder_weights_option_loads_the_named_file(tiny, tmp_path, capsys):
    bad = tmp_path / "weights.pth"
    bad.write_bytes(b"not a state dict")
    argv = ["train", "--config", str(tiny), "--out", str(tmp_path / "run"), "--encoder-weights", str(bad)]
    assert main(argv + ["model.encoder.name=resnet50"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "weights.pth" in err


@pytest.mark.parametrize("n, batch, world",
                         [(160, 16, 1), (161, 16, 2), (33, 16, 2), (7, 2, 3), (5, 4, 4), (40, 64, 3)])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("by_length", [False, True])
def test_epoch_batches_cover_every_item_once_with_equal_steps_per_rank(n, batch, world, grouped, by_length):
    groups = [i // 5 for i in range(n)] if grouped else None
    lengths = [3 + (7 * i) % 11 for i in range(n)] if by_length else None
    for epoch in (0, 1):
        per_rank = [epoch_batches(n, batch, 0, epoch, r, world, groups=groups, lengths=lengths, pool=2)
                    for r in range(world)]
        assert {len(b) for b in per_rank} == {steps_per_epoch(n, batch, world)}
        seen = sorted(i for batches in per_rank for b in batches for i in b)
        assert seen == list(range(n))
        assert all(len(b) >= 1 for batches in per_rank for b in batches)
    if n > 10:  # enough images for the two orders to differ
        assert epoch_batches(n, batch, 0, 0, groups=groups) != epoch_batches(n, batch, 0, 1, groups=groups)
    assert epoch_batches(n, batch, 0, 1, groups=groups) == epoch_batches(n, batch, 0, 1, groups=groups)


@pytest.mark.parametrize("world", [1, 2])
def test_grouping_keeps_an_images_captions_together_at_the_configs_batch_size(world):
    """5 captions per image, 32 captions per batch and rank (what the shipped configs use): a batch
    holds 6 or 7 images and at most the ends of 2 more, since an image's captions are cut only where
    a batch ends; a plain shuffle scatters a batch over ~30 images."""
    groups = [i // 5 for i in range(3000)]

    def batches(grouped):
        return [b for r in range(world) for b in epoch_batches(3000, 32, 0, 0, r, world,
                                                               groups=groups if grouped else None)]

    per_batch = [len({groups[i] for i in b}) for b in batches(True)]
    assert max(per_batch) <= 8 and sum(per_batch) / len(per_batch) < 7.5
    spans = Counter(g for b in batches(True) for g in {groups[i] for i in b})  # batches holding each image
    assert max(spans.values()) == 2 and sum(n == 1 for n in spans.values()) > 400  # most images stay whole
    scattered = [len({groups[i] for i in b}) for b in batches(False)]
    assert sum(scattered) / len(scattered) > 25


@pytest.mark.parametrize("grouped", [False, True])
def test_grouping_by_length_shortens_batches_and_stays_a_shuffle(grouped):
    """Captions of Flickr8k-like lengths (6-21 tokens): sorted in pools of 50 batches, a batch's longest
    caption is much shorter on average (the decoder runs one step per token of it); an image's captions
    still share a batch, and each epoch is another order."""
    gen = torch.Generator().manual_seed(0)
    lengths = (6 + torch.poisson(torch.full((5000,), 6.0), generator=gen).clamp(max=15)).long().tolist()
    groups = [i // 5 for i in range(5000)] if grouped else None

    def longest(by_length, epoch=0):
        batches = epoch_batches(5000, 32, 0, epoch, groups=groups, lengths=lengths if by_length else None)
        return [max(lengths[i] for i in b) for b in batches], batches

    plain, _ = longest(False)
    sorted_, batches = longest(True)
    assert sum(sorted_) / len(sorted_) < 0.9 * sum(plain) / len(plain)
    if grouped:
        spans = Counter(groups[i] for b in batches for i in {groups[i]: i for i in b}.values())
        assert max(spans.values()) <= 2 and sum(n == 1 for n in spans.values()) > 800
    assert longest(True, 1)[1] != batches and longest(True, 0)[1] == batches
    assert sorted(i for b in batches for i in b) == list(range(5000))


def test_schedules():
    assert lr_factor(0, 100, 10, "cosine") == pytest.approx(0.1)
    assert lr_factor(10, 100, 10, "cosine") == pytest.approx(1.0)
    assert lr_factor(100, 100, 10, "cosine") == pytest.approx(0.0)
    assert lr_factor(50, 100, 0, "constant") == 1.0
    assert [sampling_probability(0.4, e, 5) for e in range(5)] == pytest.approx([0, 0.1, 0.2, 0.3, 0.4])


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    import random

    import numpy as np

    state = capture_rng()
    torch.save(state, tmp_path / "rng.pt")
    expected = (torch.rand(3), random.random(), np.random.rand())
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert torch.equal(torch.rand(3), expected[0])
    assert (random.random(), np.random.rand()) == expected[1:]


def test_seeded_items_give_a_batch_the_same_augmentation_whenever_it_is_loaded():
    class Noisy(torch.utils.data.Dataset):
        """Stands in for a dataset with random augmentation: one random draw per distinct image."""

        def __len__(self):
            return 10

        def __getitem__(self, i):
            return torch.rand(2)

        def __getitems__(self, indices):
            drawn = {i // 5: torch.rand(2) for i in indices}  # items 0-4 are image 0, 5-9 image 1
            return [drawn[i // 5] for i in indices]

    items = SeededItems(Noisy(), seed=3)
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    first = items.__getitems__([0, 1, 5])
    assert torch.equal(torch.rand(1), before)  # the caller's RNG did not move
    assert torch.equal(first[0], first[1]) and not torch.equal(first[0], first[2])  # the dataset's sharing kept
    again = items.__getitems__([0, 1, 5])
    assert all(torch.equal(a, b) for a, b in zip(first, again))  # a resumed run sees the same crops
    items.set_epoch(1)
    assert not torch.equal(items.__getitems__([0, 1, 5])[0], first[0])  # a new epoch, new crops


def test_meter_round_trips_and_reads_the_lists_older_checkpoints_hold():
    from captioner.training.loss import LossOutput

    meter = Meter()
    meter.add(LossOutput(*(torch.tensor(v) for v in (4.0, 3.0, 2.0, 1.0, 0.5, 0.25))), captions=10, tokens=50,
              seconds=0.5)
    restored = Meter()
    restored.load(meter.totals())
    expected = {"total": 40.0, "xent": 30.0, "coverage": 20.0, "entropy": 10.0, "reward": 5.0, "box": 2.5,
                "captions": 10.0, "tokens": 50.0, "steps": 1.0, "seconds": 0.5}
    assert restored.totals() == meter.totals() == expected
    assert meter.means() == {"total": 4.0, "xent": 3.0, "coverage": 2.0, "entropy": 1.0, "reward": 0.5, "box": 0.25}
    named = Meter()
    named.load({k: v for k, v in expected.items() if k != "box"})  # a last.pt from before the box term
    assert named.totals() == {**expected, "box": 0.0}
    listed = Meter()
    listed.load([40.0, 30.0, 20.0, 10.0, 5.0, 10.0, 50.0, 1.0, 0.5])  # a last.pt of 0.2: the totals as a list
    assert listed.totals() == {**expected, "box": 0.0}
    older = Meter()
    older.load([40.0, 30.0, 20.0, 10.0, 10.0, 50.0, 1.0, 0.5])  # a last.pt of 0.1: no reward term
    assert older.totals() == {**expected, "reward": 0.0, "box": 0.0}
    oldest = Meter()
    oldest.load([40.0, 30.0, 20.0, 10.0, 50.0, 1.0, 0.5])  # before the entropy term too
    assert oldest.totals() == {**expected, "entropy": 0.0, "reward": 0.0, "box": 0.0}
    empty = Meter()
    empty.load(Meter().totals())
    assert empty.sums is None and empty.totals() == Meter().totals()


def test_every_metrics_line_reaches_tensorboard_when_it_is_installed(tiny, tmp_path, monkeypatch):
    """tensorboard is optional (not a dependency): the writer the run opens in RUN/tb gets each line's
    scalars at its step, and is closed at the end. A recording writer stands in for SummaryWriter."""
    from captioner.training import state

    class Recorder:
        def __init__(self, folder):
            self.folder, self.scalars, self.closed = folder, [], False

        def add_scalar(self, name, value, step):
            self.scalars.append((name, value, step))

        def close(self):
            self.closed = True

    writers = []
    monkeypatch.setattr(state, "_summary_writer", lambda out_dir: writers.append(Recorder(out_dir / "tb")) or writers[-1])
    train(run_config(tiny, ["train.epochs=1"]), tmp_path / "run", "cpu")
    (writer,) = writers
    lines = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    expected = [(k, v, ln["step"]) for ln in lines for k, v in ln.items() if k not in ("epoch", "step")]
    assert writer.folder == tmp_path / "run" / "tb" and writer.scalars == expected and writer.closed
    assert any(name == "val_CIDEr" for name, _, _ in writer.scalars)


def test_schedule_epochs_lays_the_cosine_over_more_epochs_than_the_run_trains(tiny, tmp_path):
    """`train.schedule_epochs` (the Flickr8k recipe: 7 of a cosine over 8): the run stops after
    `epochs` with the learning rate where the longer schedule has it then, not at 0."""
    result = train(run_config(tiny, ["train.epochs=1", "train.schedule_epochs=2", "train.schedule=cosine"]),
                   tmp_path / "run", "cpu")
    (line,) = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert result.steps == 10 and line["step"] == 10  # one epoch of 10 steps, validated
    assert line["lr"] == pytest.approx(0.005 * lr_factor(10, 20, 0, "cosine"))  # half way: 0.0025
    with pytest.raises(ConfigError, match="schedule_epochs.*shorter than train.epochs"):
        run_config(tiny, ["train.epochs=3", "train.schedule_epochs=2"])


def test_max_steps_ends_the_run_there_validated_with_the_schedule_fitted_to_it(tiny, tmp_path):
    """`train.max_steps` (a short fine-tuning): the run stops mid-epoch after that many steps, validates
    and checkpoints them, and its cosine schedule ends there, not at the epochs' end."""
    result = train(run_config(tiny, ["train.max_steps=14", "train.schedule=cosine"]), tmp_path / "run", "cpu")
    assert result.steps == 14 and not result.interrupted  # 10 steps an epoch: stopped in the second
    lines = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [10, 14] and "val_CIDEr" in lines[-1]
    assert lines[-1]["lr"] == pytest.approx(0.0, abs=1e-6)  # the cosine has reached its end at step 14
    assert load_checkpoint(result.best).meta["step"] in (10, 14)
    again = train(run_config(None, [], resume=result.last), tmp_path / "run", "cpu", resume=result.last)
    assert again.steps == 14  # resumed after its last step: nothing more to do
