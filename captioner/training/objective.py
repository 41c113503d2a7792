"""What a kind of training does with a batch: the objective the loop calls.

    Objective      the protocol: `collate` (items -> a batch), `set_epoch`, `loss(batch) -> BatchLoss`, `log`
    CrossEntropy   teacher forcing on the reference captions (a `build_criterion` loss)
    SelfCritical   (`captioner.training.scst`) CIDEr-D of the model's own samples against a baseline

The loop knows nothing else of either: it takes an optimiser step on `BatchLoss.loss.total`, adds the
detached terms to the meter, and puts what `log` returns into the metrics line.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from captioner.config import TrainConfig
from captioner.data.datasets import Batch
from captioner.data.datasets import collate as collate_captions
from captioner.training.boxes import BoxTargets
from captioner.training.loss import Criterion, LossOutput


class BatchLoss(NamedTuple):
    """What one batch cost: its loss terms (`total` with gradients) and what they are averaged over."""

    loss: LossOutput
    captions: int  # captions scored: the weight of these terms in the running means
    tokens: int  # tokens scored (throughput)


class Objective(Protocol):
    """One kind of training. `net` is what `loss` runs with gradients (DDP-wrapped when distributed);
    `collate` makes the batch `loss` takes of a batch's items (a plain function: loader workers get it)."""

    net: nn.Module
    collate: Callable[[Sequence[Any]], Any]

    def set_epoch(self, epoch: int) -> None:
        """Called before each epoch's steps (0-based)."""

    def loss(self, batch: Any) -> BatchLoss:
        """The loss of one batch, with gradients."""

    def log(self, means: Mapping[str, float], seconds: float) -> dict[str, float]:
        """The loss entries of a metrics line, from the meter's per-caption means of each `LossOutput`
        term since the last line and the seconds all ranks trained in that time."""


def sampling_probability(final: float, epoch: int, epochs: int) -> float:
    """Scheduled sampling: 0 in the first epoch, rising linearly to `final` in the last."""
    if final <= 0.0 or epochs <= 1:
        return 0.0 if epochs > 1 else final
    return final * min(1.0, epoch / (epochs - 1))


def logged_terms(means: Mapping[str, float], cfg: TrainConfig) -> dict[str, float]:
    """`loss` and `xent` always; `coverage`, `entropy` and `box` when their weights are set."""
    return {"loss": means["total"], "xent": means["xent"],
            **({"coverage": means["coverage"]} if cfg.coverage_weight else {}),
            **({"entropy": means["entropy"]} if cfg.entropy_weight else {}),
            **({"box": means["box"]} if cfg.box_weight else {})}


class CrossEntropy:
    """Cross-entropy on batches of reference captions (`Batch`), with the config's attention terms
    and scheduled sampling.

    Args:
        net: the decoder (the batches hold cached grids) or the whole model (pixels), DDP-wrapped
            when distributed.
        cfg: the run's training settings: scheduled sampling, epochs, which terms are logged.
        criterion: the loss of a packed pass (`build_criterion`).
        device, amp_dtype: where the steps run, and under which autocast dtype (None: float32).
        boxes: the training photos' boxed objects, for `train.box_weight` (None: no box term).
    """

    collate = staticmethod(collate_captions)  # captions padded, each distinct image once

    def __init__(self, net: nn.Module, cfg: TrainConfig, criterion: Criterion, device: torch.device,
                 amp_dtype: torch.dtype | None = None, boxes: BoxTargets | None = None) -> None:
        self.net, self.cfg, self.criterion, self.device, self.amp_dtype = net, cfg, criterion, device, amp_dtype
        self.boxes = boxes
        self.sampling_prob = 0.0

    def set_epoch(self, epoch: int) -> None:
        self.sampling_prob = sampling_probability(self.cfg.scheduled_sampling, epoch, self.cfg.epochs)

    def loss(self, batch: Batch) -> BatchLoss:
        device, amp_dtype = self.device, self.amp_dtype
        inputs = batch.inputs.to(device, non_blocking=True)  # (N, L, D) features or (N, 3, S, S) images
        tokens = batch.tokens.to(device, non_blocking=True)  # (B, T + 1)
        lengths = batch.lengths.to(device, non_blocking=True)  # (B,)
        rows = batch.rows.to(device, non_blocking=True)  # (B,) each caption's image
        cells = None if self.boxes is None else self.boxes.cells(batch.tokens, batch.image_ids)  # (B, T, L) bool
        images = None  # the image id of each cached grid (N,): what a teacher computes of a photo can be kept
        if batch.inputs.dim() == 3:
            images = torch.empty(inputs.size(0), dtype=torch.long).index_put_((batch.rows,), batch.image_ids).to(device)
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            out = self.net(inputs, tokens, lengths, rows, sampling_prob=self.sampling_prob,
                           detect=self.criterion.detector_outputs(tokens))  # packed: (P, V), (P, L)
            loss = self.criterion(out, tokens, box_cells=cells, images=images)
        return BatchLoss(loss, len(batch.lengths), int(batch.lengths.sum()))

    def log(self, means: Mapping[str, float], seconds: float) -> dict[str, float]:
        return logged_terms(means, self.cfg)
