"""A training run's state, and its checkpoints: what `last.pt` holds so that a resumed run
continues exactly, and `best.pt`.

`last.pt` is written at the end of every epoch and every `train.checkpoint_every_steps` steps; it
holds the optimiser, scheduler and scaler states, the position (epoch, batches consumed, step),
early-stopping state, every rank's RNG states (torch, CUDA, Python, NumPy) and loss sums, and what
the data order depends on. The run config is stored once, in the checkpoint's `config`.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from captioner.config import Config, to_dict
from captioner.data.order import EpochBatchSampler, mix_seed, steps_per_epoch
from captioner.data.vocab import Vocabulary
from captioner.files import atomic_write_text, naming_write_errors
from captioner.model.caption_model import CaptionModel
from captioner.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from captioner.training.distributed import DistInfo, all_gather_objects, barrier, capture_rng, restore_rng
from captioner.training.loss import LossOutput
from captioner.training.objective import Objective

log = logging.getLogger(__name__)

LAST, BEST, METRICS, CONFIG = "last.pt", "best.pt", "metrics.jsonl", "config.yaml"


@dataclass
class TrainState:
    """Where the run is; everything here goes into `last.pt` as plain values."""

    epoch: int = 0  # the epoch being trained (0-based); == epochs when done
    batch: int = 0  # batches of `epoch` already consumed
    step: int = 0  # optimiser steps taken
    best: float | None = None  # best validation value of `train.val_metric`
    best_step: int = -1
    bad_validations: int = 0  # validations in a row without improvement (early stopping)
    last_val_step: int = -1


class Meter:
    """Running sums since the last metrics line: each `LossOutput` term weighted by its captions (kept
    on the device: no sync per step), and the captions, tokens, steps and seconds."""

    TERMS = LossOutput._fields  # total, xent, coverage, entropy, reward, box
    COUNTS = ("captions", "tokens", "steps", "seconds")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sums: Tensor | None = None  # (TERMS,) caption-weighted loss terms
        self.captions = self.tokens = self.steps = 0
        self.seconds = 0.0

    def add(self, loss: LossOutput, captions: int, tokens: int, seconds: float) -> None:
        values = torch.stack(list(loss)).detach().float() * captions  # (TERMS,)
        self.sums = values if self.sums is None else self.sums + values
        self.captions += captions
        self.tokens += tokens
        self.steps += 1
        self.seconds += seconds

    def totals(self) -> dict[str, float]:
        """Each term's sum and the counts, by name (TERMS, then COUNTS), as floats."""
        sums = self.sums.tolist() if self.sums is not None else [0.0] * len(self.TERMS)
        counts = (float(self.captions), float(self.tokens), float(self.steps), self.seconds)
        return dict(zip((*self.TERMS, *self.COUNTS), (*sums, *counts)))

    def means(self, totals: dict[str, float] | None = None) -> dict[str, float]:
        """Each term's mean per caption, of `totals` (say summed over the ranks) or of this meter's."""
        totals = self.totals() if totals is None else totals
        return {k: totals[k] / max(totals["captions"], 1) for k in self.TERMS}

    def load(self, totals: dict[str, float] | list[float]) -> None:
        """Continue from `totals()` as a checkpoint stored it; a term it lacks (an older run's) counts 0."""
        if isinstance(totals, list):
            totals = _listed_totals(totals)
        self.sums = torch.tensor([totals.get(k, 0.0) for k in self.TERMS], dtype=torch.float32) \
            if totals["captions"] else None
        self.captions, self.tokens, self.steps = int(totals["captions"]), int(totals["tokens"]), int(totals["steps"])
        self.seconds = float(totals["seconds"])


def _listed_totals(values: list[float]) -> dict[str, float]:
    """The totals as `last.pt` held them before they were named: a list of the loss terms of its time
    (total, xent, coverage, then entropy, then reward: 3, 4 or 5 of them), captions, tokens, steps,
    seconds."""
    terms = Meter.TERMS[: len(values) - len(Meter.COUNTS)]
    return dict(zip((*terms, *Meter.COUNTS), values))


@dataclass
class Run:
    """Everything a recipe's `setup` builds and its loop runs."""

    cfg: Config
    out_dir: Path
    device: torch.device
    dist: DistInfo
    vocab: Vocabulary
    model: CaptionModel  # the plain model (checkpoints, decoding)
    objective: Objective  # what a step does with a batch (its `net` is what the steps run)
    cached: bool  # the batches hold grids from the feature cache (else images for the encoder)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    amp_dtype: torch.dtype | None
    train_set: Dataset  # what the objective's batches are made of: captions, or images (self-critical)
    sampler: EpochBatchSampler
    val_loader: DataLoader  # this rank's share of the validation images
    references: dict[int, list[str]]  # val image_id -> raw reference captions
    meta: dict[str, Any]  # facts for the checkpoints: split sizes, captions
    state: TrainState = field(default_factory=TrainState)
    meter: Meter = field(default_factory=Meter)
    writer: Any = None  # TensorBoard SummaryWriter when tensorboard is installed (rank 0)
    history: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # last validation
    replacing: bool = False  # out_dir holds another run, to be removed at this run's first checkpoint
    claimed: bool = False  # the folder is this run's: its first checkpoint was written (or it is resumed)

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.sampler.n, self.sampler.batch_size, self.dist.world_size)


# --- checkpoints ------------------------------------------------------------------------------


def _train_state(run: Run) -> dict[str, Any]:
    """What resuming needs. Collective: every rank must call it (RNG states are gathered)."""
    rngs = all_gather_objects(capture_rng())
    meters = all_gather_objects(run.meter.totals())
    return {
        "optimizer": run.optimizer.state_dict(),
        "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict() if run.scaler.is_enabled() else None,
        "position": asdict(run.state),
        "meter": meters,  # per rank, like the RNG states
        "rng": rngs,
        "data_order": data_order(run),
    }


def data_order(run: Run) -> dict[str, int]:
    """What the data order depends on: a resume with other values cannot continue it exactly."""
    sm = run.sampler
    return {"captions": sm.n, "batch_size": sm.batch_size, "seed": sm.seed, "world_size": sm.world_size,
            "group_by_image": sm.groups is not None, "group_by_length": sm.lengths is not None}


def _meta(run: Run) -> dict[str, Any]:
    st = run.state
    return {**run.meta, "epoch": st.epoch, "step": st.step, "metrics": dict(run.metrics),
            "best": {"metric": run.cfg.train.val_metric, "value": st.best, "step": st.best_step}}


def existing_run(folder: Path) -> str | None:
    """What of a training run `folder` holds ("last.pt at step 120", "best.pt, metrics.jsonl"), or None."""
    found = [name for name in (LAST, BEST, METRICS) if (folder / name).exists()]
    if not found:
        return None
    if LAST in found:
        try:
            return f"{LAST} at step {load_checkpoint(folder / LAST).meta.get('step', '?')}"
        except CheckpointError:
            pass
    return ", ".join(found)


def claim(run: Run) -> None:
    """Make the run folder this run's (rank 0, at its first checkpoint): what an earlier run left
    (its checkpoints, metrics, TensorBoard logs) goes now, not before, so a run that fails before
    its first checkpoint never costs the earlier one anything."""
    if run.claimed or not run.dist.is_main:
        return
    for name in (LAST, BEST, METRICS):
        (run.out_dir / name).unlink(missing_ok=True)
    for kept in run.out_dir.glob("step-*.pt"):
        kept.unlink()
    shutil.rmtree(run.out_dir / "tb", ignore_errors=True)
    _start_files(run)


def _start_files(run: Run) -> None:
    atomic_write_text(run.out_dir / CONFIG, yaml.safe_dump(to_dict(run.cfg), sort_keys=False))
    run.writer = _summary_writer(run.out_dir)
    run.claimed = True


def save_last(run: Run) -> Path:
    """Write `last.pt` (atomic; rank 0). Collective: call it on every rank."""
    train_state = _train_state(run)
    path = run.out_dir / LAST
    if run.dist.is_main:
        if not run.claimed:
            claim(run)
        save_checkpoint(path, run.cfg, run.vocab, run.model.state_dict(), train_state, _meta(run))
    barrier()
    return path


def save_best(run: Run, name: str = BEST) -> Path:
    """Write `best.pt` (or `name`): the model, vocabulary, config and metrics, no resume state (rank 0 only)."""
    if not run.claimed:
        claim(run)
    path = run.out_dir / name
    save_checkpoint(path, run.cfg, run.vocab, run.model.state_dict(), None, _meta(run))
    return path


def append_metrics(run: Run, line: dict[str, Any]) -> None:
    """One line of metrics.jsonl (rank 0), and the same scalars to TensorBoard when it is installed."""
    with naming_write_errors(run.out_dir / METRICS), open(run.out_dir / METRICS, "a") as f:
        f.write(json.dumps(line) + "\n")
    if run.writer is not None:
        for k, v in line.items():
            if k not in ("epoch", "step"):
                run.writer.add_scalar(k, v, line["step"])


def _summary_writer(out_dir: Path) -> Any:
    if importlib.util.find_spec("tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(out_dir / "tb"))


def restore(run: Run, ts: dict[str, Any]) -> None:
    """Load optimiser, scheduler, scaler, position and this rank's RNG from a checkpoint's train_state."""
    try:
        run.optimizer.load_state_dict(ts["optimizer"])
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"the checkpoint's optimiser state does not fit this model ({e})") from None
    run.scheduler.load_state_dict(ts["scheduler"])
    if ts.get("scaler"):
        run.scaler.load_state_dict(ts["scaler"])
    run.state = TrainState(**ts["position"])
    order = ts["data_order"]
    now = data_order(run)
    if order != now:
        changed = ", ".join(f"{k} {order.get(k)} -> {v}" for k, v in now.items() if order.get(k) != v)
        log.warning("the data order differs from the interrupted run's (%s): the resume is not exact%s", changed,
                    "; the interrupted epoch starts over" if run.state.batch else "")
        run.state.batch = 0  # a position in the old order means nothing in the new one
    rngs = ts["rng"]
    if len(rngs) == run.dist.world_size:
        restore_rng(rngs[run.dist.rank])
        run.meter.load(ts["meter"][run.dist.rank])
    else:
        log.warning("checkpoint has RNG states of %d processes, this run has %d: reseeding", len(rngs),
                    run.dist.world_size)
        torch.manual_seed(mix_seed(run.cfg.train.seed, run.dist.rank, run.state.step))
    if run.dist.is_main:
        truncate_metrics(run.out_dir / METRICS, run.state.step)
        _start_files(run)
    log.info("resumed at epoch %d, batch %d, step %d", run.state.epoch + 1, run.state.batch, run.state.step)


def truncate_metrics(path: Path, step: int) -> None:
    """Drop the lines a killed run wrote after its last checkpoint (they will be written again)."""
    if not path.is_file():
        return
    keep, lines = [], [ln for ln in path.read_text().splitlines() if ln.strip()]
    for ln in lines:
        try:
            if json.loads(ln).get("step", 0) <= step:
                keep.append(ln)
        except json.JSONDecodeError:  # the half-written last line of a killed run
            pass
    if len(keep) != len(lines):
        atomic_write_text(path, "".join(ln + "\n" for ln in keep))
