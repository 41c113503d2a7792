"""Training loss: cross-entropy over real tokens plus the doubly stochastic attention regulariser.

Shapes: B batch, T tokens, V vocabulary, L regions.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


class LossOutput(NamedTuple):
    total: Tensor  # scalar: xent + alpha_reg * attention
    xent: Tensor  # scalar: mean cross-entropy per real token
    attention: Tensor  # scalar: mean over images of sum_regions (1 - sum_t alpha)^2


def token_mask(lengths: Tensor, T: int) -> Tensor:
    """(B,) lengths -> (B, T) bool, True on the first lengths[b] positions."""
    return torch.arange(T, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)


def caption_loss(
    logits: Tensor,
    targets: Tensor,
    lengths: Tensor,
    alphas: Tensor,
    alpha_reg: float = 1.0,
    label_smoothing: float = 0.0,
    region_mask: Tensor | None = None,
) -> LossOutput:
    """Cross-entropy over real tokens + `alpha_reg * sum_regions (1 - sum_t alpha)^2` (Show, Attend and Tell).

    Args:
        logits: (B, T, V) predictions for targets.
        targets: (B, T) token ids (tokens[:, 1:]); positions at or past `lengths` are ignored.
        lengths: (B,) number of real target positions (words + <end>).
        alphas: (B, T, L) attention weights of every step.
        alpha_reg: weight of the regulariser, which asks every region to be looked at about once
            over the caption; 0 turns it off.
        label_smoothing: passed to cross-entropy.
        region_mask: optional (B, L) bool, True on real regions; padded regions are not penalised.
    """
    B, T, V = logits.shape
    valid = token_mask(lengths, T)  # (B, T)
    xent = F.cross_entropy(
        logits[valid].float(), targets[valid], label_smoothing=label_smoothing
    )  # (N, V) over the N real tokens
    coverage = (alphas.float() * valid.unsqueeze(-1)).sum(dim=1)  # (B, L): attention each region got
    penalty = (1.0 - coverage) ** 2  # (B, L)
    if region_mask is not None:
        penalty = penalty * region_mask
    attention = penalty.sum(dim=1).mean()
    return LossOutput(xent + alpha_reg * attention, xent, attention)
