"""The training loop (`captioner train`), in the torchvision-references / torchtune recipe style.

    train(cfg, out_dir, device, resume) -> TrainResult   what the CLI calls; the same under torchrun
    fit(run) -> TrainResult                              epochs of `train_one_epoch`, validation, checkpoints
    train_one_epoch(net, criterion, optimizer, ...)      the steps of one epoch (or what is left of it)
    validate(run)                                        decode the validation images, score, keep best.pt

`setup` (captioner.training.setup) builds the `Run`; its checkpoints are `captioner.training.state`'s.
With `train.group_by_image` (the default) an image's captions share a batch, so its grid is encoded
(or projected) once for all of them; the decoder computes only real positions, so padding costs
nothing either way.

Exact resume: the data order is a pure function of (seed, epoch, rank, world size) (see
`captioner.data.order`), DataLoaders get their own seeded generators (so creating one never moves
the global RNG), augmentation is seeded per (epoch, item), and `last.pt` holds every RNG state. A
resumed run therefore continues on the very batch it stopped at, with the same random state, and
ends with the same weights as a run that was never interrupted.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from captioner.config import Config, DecodeConfig
from captioner.data.datasets import Batch, ImageBatch, collate, collate_images
from captioner.data.order import SeededItems, mix_seed
from captioner.data.vocab import Vocabulary
from captioner.decoding.metrics import caption_metrics, diversity
from captioner.decoding.search import decode
from captioner.errors import CaptionerError
from captioner.model.caption_model import CaptionModel
from captioner.model.checkpoint import load_checkpoint
from captioner.runtime import resolve_device
from captioner.training.distributed import (
    all_gather_objects,
    all_reduce_sum,
    broadcast_object,
    dist_from_env,
    init_distributed,
    max_over_ranks,
    shutdown_distributed,
)
from captioner.training.loss import Criterion, LossOutput, build_criterion
from captioner.training.setup import setup
from captioner.training.state import BEST, LAST, Meter, Run, append_metrics, save_best, save_last
from captioner.training.stop import StopRequest

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    out_dir: Path
    last: Path
    best: Path | None
    metric: str  # train.val_metric
    best_value: float | None
    best_step: int
    epochs: int  # completed epochs
    steps: int
    stopped_early: bool
    metrics: dict[str, float]  # last validation
    history: list[dict[str, Any]]  # the metrics lines written in this session
    interrupted: int | None = None  # the signal (SIGINT, SIGTERM) that stopped the run at a checkpoint


def sampling_probability(final: float, epoch: int, epochs: int) -> float:
    """Scheduled sampling: 0 in the first epoch, rising linearly to `final` in the last."""
    if final <= 0.0 or epochs <= 1:
        return 0.0 if epochs > 1 else final
    return final * min(1.0, epoch / (epochs - 1))



def train_loader(run: Run, epoch: int, start_batch: int) -> DataLoader:
    """This rank's batches of `epoch` from `start_batch` on. The loader's own generator (seeded per
    epoch) keeps the global RNG untouched when iteration starts."""
    run.sampler.set_epoch(epoch, start_batch)
    if isinstance(run.train_set, SeededItems):
        run.train_set.set_epoch(epoch)
    return DataLoader(run.train_set, batch_sampler=run.sampler, collate_fn=collate if run.scst is None else collate_images,
                      num_workers=run.cfg.data.num_workers, pin_memory=run.device.type == "cuda",
                      generator=torch.Generator().manual_seed(mix_seed(run.cfg.train.seed, epoch)))


# --- steps ------------------------------------------------------------------------------------


Step = Callable[[Any], tuple[LossOutput, int, int]]  # a batch -> (detached loss terms, captions, tokens)


def optimize(total: Tensor, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
             scaler: torch.amp.GradScaler, grad_clip: float = 0.0) -> None:
    """Backward, clip, one optimiser and one scheduler step."""
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(total).backward()
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()


def train_step(net: nn.Module, criterion: Criterion, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: torch.amp.GradScaler, batch: Batch,
               device: torch.device, amp_dtype: torch.dtype | None = None, sampling_prob: float = 0.0,
               grad_clip: float = 0.0) -> LossOutput:
    """One cross-entropy optimiser step on a batch of captions; returns the (detached) loss terms."""
    inputs = batch.inputs.to(device, non_blocking=True)  # (N, L, D) features or (N, 3, S, S) images
    tokens = batch.tokens.to(device, non_blocking=True)  # (B, T + 1)
    lengths = batch.lengths.to(device, non_blocking=True)  # (B,)
    rows = batch.rows.to(device, non_blocking=True)  # (B,) each caption's image
    with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
        out = net(inputs, tokens, lengths, rows, sampling_prob=sampling_prob)  # packed: logits (P, V), alphas (P, L)
        loss = criterion(out, tokens)
    optimize(loss.total, optimizer, scheduler, scaler, grad_clip)
    return LossOutput(*(t.detach() for t in loss))


def epoch_step(run: Run, criterion: Criterion, sampling_prob: float) -> Step:
    """What one step of `run` does with a batch: cross-entropy on its captions, or self-critical
    training on its images (`run.scst`)."""
    tc = run.cfg.train
    if run.scst is None:
        def step(batch: Batch) -> tuple[LossOutput, int, int]:
            loss = train_step(run.net, criterion, run.optimizer, run.scheduler, run.scaler, batch, run.device,
                              run.amp_dtype, sampling_prob, tc.grad_clip)
            return loss, len(batch.lengths), int(batch.lengths.sum())
    else:
        def step(batch: ImageBatch) -> tuple[LossOutput, int, int]:
            loss = run.scst.loss(batch, run.device, run.amp_dtype)
            optimize(loss.total, run.optimizer, run.scheduler, run.scaler, tc.grad_clip)
            samples = len(batch.image_ids) * tc.scst_samples
            return LossOutput(*(t.detach() for t in loss)), samples, samples
    return step


def train_one_epoch(step: Step, loader: DataLoader, meter: Meter, *, log_every: int = 10,
                    after_step: Callable[[LossOutput], bool] | None = None, progress: bool = True,
                    desc: str = "train") -> int:
    """Run `step` on every batch of `loader`, adding to `meter`. `after_step(loss)` runs after each
    step (checkpoints, step validation) and ends the epoch early by returning True. Time spent in it
    is not counted as training time. Returns the number of steps taken."""
    steps = 0
    bar = tqdm(loader, desc=desc, unit="batch", leave=False, dynamic_ncols=True, disable=None if progress else True)
    tick = time.perf_counter()
    for batch in bar:
        loss, captions, tokens = step(batch)
        now = time.perf_counter()
        meter.add(loss, captions, tokens, now - tick)
        steps += 1
        if steps % max(1, log_every) == 0 and not bar.disable:
            bar.set_postfix(loss=f"{loss.total.item():.3f}", cap_s=f"{meter.captions / max(meter.seconds, 1e-9):.0f}")
        if after_step is not None and after_step(loss):
            break
        tick = time.perf_counter()
    bar.close()
    return steps


@torch.no_grad()
def decode_and_score(model: CaptionModel, loader: DataLoader, references: dict[int, list[str]], vocab: Vocabulary,
             decode_cfg: DecodeConfig, device: torch.device, *, cached: bool, amp_dtype: torch.dtype | None = None,
             is_main: bool = True, meteor: bool = False) -> tuple[dict[str, float], dict[int, str]]:
    """Decode this rank's validation images, gather every rank's captions, score them on rank 0.

    Returns (metrics, captions by image_id), the same on every rank.
    """
    was_training = model.training
    model.eval()
    captions: dict[int, str] = {}
    for batch in loader:
        inputs = batch.inputs.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            features = inputs if cached else model.encode(inputs)  # (B, L, D)
            hyps = decode(model.decoder, features, decode_cfg, vocab)
        for image_id, h in zip(batch.image_ids.tolist(), hyps):
            captions[image_id] = " ".join(vocab.decode(h.tokens))
    model.train(was_training)
    merged: dict[int, str] = {}
    for part in all_gather_objects(captions):
        merged.update(part)
    metrics = None
    if is_main:
        metrics = caption_metrics({i: references[i] for i in merged}, merged, meteor=meteor)
        metrics.update(diversity(list(merged.values())))
    return broadcast_object(metrics), merged


# --- validation and the loop ------------------------------------------------------------------


def validate(run: Run) -> bool:
    """Score the validation images, keep `best.pt`, write the metrics line. Returns True when
    early stopping says stop. Collective."""
    tc, st = run.cfg.train, run.state
    loss_sum, xent_sum, coverage_sum, entropy_sum, reward_sum, n, tokens, _, seconds = all_reduce_sum(
        run.meter.totals())
    if not math.isfinite(loss_sum):
        raise CaptionerError(f"the training loss is not finite at step {st.step} (diverged): lower train.lr, "
                             f"keep train.grad_clip > 0, or resume from an earlier checkpoint")
    tick = time.perf_counter()
    metrics, captions = decode_and_score(run.model, run.val_loader, run.references, run.vocab, run.cfg.decode,
                                         run.device, cached=run.cached, amp_dtype=run.amp_dtype,
                                         is_main=run.dist.is_main, meteor=tc.val_metric == "METEOR")
    val_seconds = time.perf_counter() - tick
    run.metrics = metrics
    st.last_val_step = st.step
    value = metrics[tc.val_metric]
    if tc.keep_validated and run.dist.is_main:
        save_best(run, f"step-{st.step:07d}.pt")
    if st.best is None or value > st.best:
        st.best, st.best_step, st.bad_validations = value, st.step, 0
        if run.dist.is_main:
            save_best(run)
    else:
        st.bad_validations += 1

    seconds /= run.dist.world_size  # ranks train side by side
    line = {
        "epoch": round(st.epoch + st.batch / run.steps_per_epoch, 4), "step": st.step,
        "loss": loss_sum / max(n, 1), "xent": xent_sum / max(n, 1),
        **({"coverage": coverage_sum / max(n, 1)} if tc.coverage_weight else {}),
        **({"entropy": entropy_sum / max(n, 1)} if tc.entropy_weight else {}),
        **({"reward": reward_sum / max(n, 1),  # and the share of step time spent computing rewards
            "reward_share": round(run.scst.reward_seconds / max(seconds * run.dist.world_size, 1e-9), 4)}
           if run.scst is not None else {}),
        **{f"val_{k}": v for k, v in metrics.items()},
        "lr": run.optimizer.param_groups[0]["lr"], "seconds": round(seconds, 2), "val_seconds": round(val_seconds, 2),
        "captions_per_s": round(n / max(seconds, 1e-9), 1), "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
    }
    run.history.append(line)
    run.meter.reset()
    if run.scst is not None:
        run.scst.reward_seconds = 0.0
    if run.dist.is_main:
        append_metrics(run, line)
        star = " *" if st.best_step == st.step else ""
        log.info("epoch %.2f step %d: loss %.3f (xent %.3f)  %s %.3f%s  BLEU-4 %.3f  %.0f captions/s",
                 line["epoch"], st.step, line["loss"], line["xent"], tc.val_metric, value, star,
                 metrics.get("Bleu_4", 0.0), line["captions_per_s"])
        for image_id in sorted(captions)[:3]:
            log.info("  val %d: %s", image_id, captions[image_id])
    return tc.patience > 0 and st.bad_validations >= tc.patience


def fit(run: Run, stop_after_steps: int | None = None, request: StopRequest | None = None) -> TrainResult:
    """The training loop from wherever `run.state` stands. `stop_after_steps` ends the run (with a
    checkpoint) once that many steps are done in total: a hook for tests and smoke runs. A signal
    seen by `request` ends it the same way, after the step it arrived in (on every rank together)."""
    tc, st = run.cfg.train, run.state
    stopped_by: int | None = None
    criterion = build_criterion(tc, run.vocab)
    per_epoch = run.steps_per_epoch
    stop = tc.patience > 0 and st.bad_validations >= tc.patience  # resumed after an early stop
    early = stop
    interrupted = False
    while st.epoch < tc.epochs and not stop:

        def after_step(loss: LossOutput) -> bool:
            nonlocal stop, early, interrupted, stopped_by
            st.step += 1
            st.batch += 1
            if tc.val_every_steps > 0 and st.step % tc.val_every_steps == 0:
                early = validate(run)
                stop = stop or early
            if request is not None:  # every rank stops after the same step: the highest signal seen wins
                seen = request.signal or 0
                stopped_by = int(max_over_ranks(seen) if run.dist.enabled else seen) or None
            if stopped_by is not None or (stop_after_steps is not None and st.step >= stop_after_steps):
                stop = interrupted = True
            elif st.batch < per_epoch and (stop or (tc.checkpoint_every_steps > 0
                                                    and st.step % tc.checkpoint_every_steps == 0)):
                save_last(run)
            return stop

        loader = train_loader(run, st.epoch, st.batch)
        step = epoch_step(run, criterion, sampling_probability(tc.scheduled_sampling, st.epoch, tc.epochs))
        run.net.train()
        train_one_epoch(step, loader, run.meter, log_every=tc.log_every, after_step=after_step,
                        progress=run.dist.is_main, desc=f"epoch {st.epoch + 1}/{tc.epochs}")
        if st.batch >= per_epoch:  # the epoch is complete
            st.epoch, st.batch = st.epoch + 1, 0
            if tc.val_every_steps <= 0:
                early = validate(run)
                stop = stop or early
            save_last(run)
        elif interrupted:
            save_last(run)
    if not interrupted and st.last_val_step != st.step:  # the last steps were never validated
        validate(run)
        save_last(run)
    if run.writer is not None:
        run.writer.close()
    best = run.out_dir / BEST
    return TrainResult(run.out_dir, run.out_dir / LAST, best if best.is_file() else None, tc.val_metric, st.best,
                       st.best_step, st.epoch, st.step, early, run.metrics, run.history, stopped_by)


# --- entry point ------------------------------------------------------------------------------


def train(cfg: Config, out_dir: str | Path, device: str | torch.device = "auto", resume: str | Path | None = None,
          *, overwrite: bool = False, stop_after_steps: int | None = None) -> TrainResult:
    """Train a model as `cfg` says, writing `last.pt`, `best.pt` and `metrics.jsonl` into `out_dir`.

    Under `torchrun` (RANK / WORLD_SIZE / LOCAL_RANK set) each process trains its share of every
    batch with DDP; only rank 0 writes files. `resume` continues a run from its `last.pt` exactly
    (same data order, RNG, optimiser state); `cfg` should then come from `run_config(..., resume)`.
    A folder holding another run is refused unless `overwrite`. Ctrl-C or SIGTERM ends the run after
    the current step with a checkpoint (`TrainResult.interrupted`). On the CPU the run is
    deterministic for a fixed seed.
    """
    import torch.distributed as torch_dist

    dist = dist_from_env()
    owns_group = dist.enabled and not torch_dist.is_initialized()
    dev = init_distributed(dist, resolve_device(device) if isinstance(device, str) else device)
    deterministic = torch.are_deterministic_algorithms_enabled()
    if dev.type == "cpu":
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        ckpt = load_checkpoint(resume) if resume is not None else None
        run = setup(cfg, Path(out_dir), dev, dist, ckpt, overwrite)
        with StopRequest() as request:
            return fit(run, stop_after_steps, request)
    finally:
        torch.use_deterministic_algorithms(deterministic)
        if owns_group:
            shutdown_distributed()
