"""The parts of a training loop, in the torchvision-references style; a recipe's `fit` runs them
(`captioner.recipes.train`).

    train_loader(run, epoch, start_batch)             this rank's batches of an epoch, from any batch on
    train_one_epoch(objective, loader, optimizer, ...) the optimiser steps of one epoch (or what is left of it)
    validate(run)                                     decode the validation images, score, keep best.pt, log

What a step does with a batch is the run's `Objective` (cross-entropy or self-critical): the loop
takes an optimiser step on its loss and knows nothing else of it.

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
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader
from tqdm import tqdm

from captioner.data.order import SeededItems, mix_seed
from captioner.decoding.scoring import caption_batches, score_captions
from captioner.errors import CaptionerError
from captioner.training.distributed import all_gather_objects, all_reduce_sum, broadcast_object
from captioner.training.loss import LossOutput
from captioner.training.objective import Objective
from captioner.training.state import Meter, Run, append_metrics, save_best

log = logging.getLogger(__name__)


def train_loader(run: Run, epoch: int, start_batch: int) -> DataLoader:
    """This rank's batches of `epoch` from `start_batch` on. The loader's own generator (seeded per
    epoch) keeps the global RNG untouched when iteration starts."""
    run.sampler.set_epoch(epoch, start_batch)
    if isinstance(run.train_set, SeededItems):
        run.train_set.set_epoch(epoch)
    return DataLoader(run.train_set, batch_sampler=run.sampler, collate_fn=run.objective.collate,
                      num_workers=run.cfg.data.num_workers, pin_memory=run.device.type == "cuda",
                      generator=torch.Generator().manual_seed(mix_seed(run.cfg.train.seed, epoch)))


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


def train_one_epoch(objective: Objective, loader: Iterable[Any], optimizer: torch.optim.Optimizer,
                    scheduler: torch.optim.lr_scheduler.LRScheduler, scaler: torch.amp.GradScaler, meter: Meter, *,
                    grad_clip: float = 0.0, log_every: int = 10, after_step: Callable[[LossOutput], bool] | None = None,
                    progress: bool = True, desc: str = "train") -> int:
    """One optimiser step on `objective.loss` of every batch of `loader`, each batch's (detached) terms
    added to `meter`. `after_step(loss)` runs after each step (checkpoints, step validation) and ends
    the epoch early by returning True; time spent in it is not counted as training time. Returns the
    number of steps taken."""
    steps = 0
    bar = tqdm(loader, desc=desc, unit="batch", leave=False, dynamic_ncols=True, disable=None if progress else True)
    tick = time.perf_counter()
    for batch in bar:
        cost = objective.loss(batch)
        optimize(cost.loss.total, optimizer, scheduler, scaler, grad_clip)
        loss = LossOutput(*(t.detach() for t in cost.loss))
        meter.add(loss, cost.captions, cost.tokens, time.perf_counter() - tick)
        steps += 1
        if steps % max(1, log_every) == 0 and not bar.disable:
            bar.set_postfix(loss=f"{loss.total.item():.3f}", cap_s=f"{meter.captions / max(meter.seconds, 1e-9):.0f}")
        if after_step is not None and after_step(loss):
            break
        tick = time.perf_counter()
    bar.close()
    return steps


def validation_scores(run: Run) -> tuple[dict[str, float], dict[int, str]]:
    """Decode this rank's validation images, gather every rank's captions, score them on rank 0.
    Returns (caption metrics, diversity and CHAIR, captions by image_id), the same on every rank. Collective."""
    captions = caption_batches(run.model, run.val_loader, run.cfg.decode, run.vocab, run.device, cached=run.cached,
                               amp_dtype=run.amp_dtype)
    merged: dict[int, str] = {}
    for part in all_gather_objects(captions):
        merged.update(part)
    metrics = None
    if run.dist.is_main:
        scores = score_captions(run.references, merged, meteor=run.cfg.train.val_metric == "METEOR")
        chair = scores.hallucination
        metrics = {**scores.metrics, **scores.diversity, "chair_i": chair.chair_i, "chair_s": chair.chair_s}
    return broadcast_object(metrics), merged


def validate(run: Run) -> bool:
    """Score the validation images, keep `best.pt` (and with `train.keep_validated` this step's
    model), write the metrics line. Returns True when early stopping says stop. Collective."""
    tc, st = run.cfg.train, run.state
    local = run.meter.totals()
    totals = dict(zip(local, all_reduce_sum(list(local.values()))))  # summed over the ranks
    if not math.isfinite(totals["total"]):
        raise CaptionerError(f"the training loss is not finite at step {st.step} (diverged): lower train.lr, "
                             f"keep train.grad_clip > 0, or resume from an earlier checkpoint")
    tick = time.perf_counter()
    metrics, captions = validation_scores(run)
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

    n, tokens, seconds = totals["captions"], totals["tokens"], totals["seconds"] / run.dist.world_size  # side by side
    line = {
        "epoch": round(st.epoch + st.batch / run.steps_per_epoch, 4), "step": st.step,
        **run.objective.log(run.meter.means(totals), totals["seconds"]),
        **{f"val_{k}": v for k, v in metrics.items()},
        "lr": run.optimizer.param_groups[0]["lr"], "seconds": round(seconds, 2), "val_seconds": round(val_seconds, 2),
        "captions_per_s": round(n / max(seconds, 1e-9), 1), "tokens_per_s": round(tokens / max(seconds, 1e-9), 1),
    }
    run.history.append(line)
    run.meter.reset()
    if run.dist.is_main:
        append_metrics(run, line)
        star = " *" if st.best_step == st.step else ""
        log.info("epoch %.2f step %d: loss %.3f (xent %.3f)  %s %.3f%s  BLEU-4 %.3f  %.0f captions/s",
                 line["epoch"], st.step, line["loss"], line["xent"], tc.val_metric, value, star,
                 metrics.get("Bleu_4", 0.0), line["captions_per_s"])
        for image_id in sorted(captions)[:3]:
            log.info("  val %d: %s", image_id, captions[image_id])
    return tc.patience > 0 and st.bad_validations >= tc.patience
