"""`captioner evaluate`, the recipe: a checkpoint (or several, an ensemble) scored on a split of its
own data set, or of another read with its data settings. The parts are `captioner.decoding`'s:
`Captioner.from_checkpoint`, then `evaluate_split` (caption metrics, diversity, grounding)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from captioner.data.records import SPLITS
from captioner.decoding.captioner import Captioner
from captioner.decoding.evaluation import Boxes, Evaluation, Progress, evaluate_split
from captioner.errors import CaptionerError
from captioner.model.checkpoint import load_checkpoint


def evaluate_checkpoint(checkpoint: str | Path | Sequence[str | Path], split: str = "test", data: str | None = None,
                        image_root: str | Path | None = None, limit: int | None = None,
                        device: str | torch.device = "auto", batch_size: int = 32, meteor: bool | None = None,
                        progress: Progress | None = None, boxes: Boxes | None = None, relevance: bool = False,
                        **decode_overrides: Any) -> tuple[Evaluation, str]:
    """Score a checkpoint on a split of its own data set (or of `data`, read with the checkpoint's
    data settings). Returns the Evaluation and the data path used.

    Args:
        checkpoint: a checkpoint file, or several (an ensemble; data settings from the first).
        split: "train", "val" or "test".
        data: another data set (folder, caption file, or "shapes") instead of the checkpoint's.
        image_root: where the images are, when not next to the caption file.
        limit: score only the first `limit` images of the split.
        device, batch_size, meteor, progress, boxes, relevance, decode_overrides: see `evaluate_records`.
    Raises:
        CaptionerError: a bad file, an empty split.
    """
    if split not in SPLITS:  # before any checkpoint is read
        raise CaptionerError(f"split {split!r}: expected one of {', '.join(SPLITS)}")
    paths = list(checkpoint) if isinstance(checkpoint, (list, tuple)) else [checkpoint]
    ckpts = [load_checkpoint(p) for p in paths]
    ckpt = ckpts[0]
    data_cfg = ckpt.config.data
    captioner = Captioner.from_checkpoint(ckpts if len(ckpts) > 1 else ckpt, device)
    del ckpt, ckpts  # the optimiser state, if any, is not needed
    return evaluate_split(captioner, data_cfg, split, data, image_root, limit, batch_size, meteor, progress, boxes,
                          relevance, **decode_overrides)
