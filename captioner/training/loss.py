"""Training loss: cross-entropy over real tokens plus two optional attention terms, the doubly
stochastic coverage term (every region looked at about once per caption) and an entropy penalty
(each word looks at few regions).

Shapes: B captions, T + 1 tokens, P real (scored) positions, V vocabulary, L regions.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from captioner.config import TrainConfig
from captioner.model.decoder import DecoderOutput


class LossOutput(NamedTuple):
    total: Tensor  # scalar: xent + coverage_weight * coverage + entropy_weight * entropy
    xent: Tensor  # scalar: mean cross-entropy per real token
    coverage: Tensor  # scalar: mean over captions and regions of (1 - sum_t alpha)^2 (0 when its weight is 0)
    entropy: Tensor  # scalar: mean entropy (nats) of a real token's attention map (0 when its weight is 0)
    reward: Tensor  # scalar: mean CIDEr-D reward of the sampled captions (self-critical training; else 0)


Criterion = Callable[[DecoderOutput, Tensor], LossOutput]  # (packed output, (B, T + 1) tokens) -> loss


def caption_loss(
    out: DecoderOutput,
    tokens: Tensor,
    coverage_weight: float = 0.0,
    entropy_weight: float = 0.0,
    label_smoothing: float = 0.0,
) -> LossOutput:
    """Cross-entropy over real tokens + `coverage_weight * mean_regions (1 - sum_t alpha)^2` (Show,
    Attend and Tell's doubly stochastic term, averaged so it does not grow with the grid) +
    `entropy_weight * mean_t H(alpha_t)`. A term whose weight is 0 is not computed.

    Args:
        out: the decoder's packed pass: logits (P, V) and alphas (P, L), row p predicting
            tokens[out.caption[p], out.step[p] + 1]. Padding was never computed, so never counts.
        tokens: (B, T + 1) the captions the decoder read.
        coverage_weight: asks every region to be looked at about once over the caption.
        entropy_weight: asks each word to commit to few regions instead of blending several
            objects into one look.
        label_smoothing: passed to cross-entropy.
    """
    targets = tokens[out.caption, out.step + 1]  # (P,)
    xent = F.cross_entropy(out.logits.float(), targets, label_smoothing=label_smoothing)
    zero = xent.new_zeros(())
    coverage = entropy = zero
    if coverage_weight:
        B, L = tokens.size(0), out.alphas.size(-1)
        looked = torch.zeros(B, L, device=tokens.device).index_add_(0, out.caption, out.alphas.float())  # (B, L)
        coverage = ((1.0 - looked) ** 2).mean()
    if entropy_weight:
        alphas = out.alphas.float()  # (P, L)
        # clamped inside the log: 0 log 0 = 0 with a finite gradient (xlogy's would be infinite)
        entropy = -(alphas * alphas.clamp_min(1e-12).log()).sum(dim=-1).mean()
    return LossOutput(xent + coverage_weight * coverage + entropy_weight * entropy, xent, coverage, entropy, zero)


def build_criterion(cfg: TrainConfig) -> Criterion:
    """`caption_loss` with the config's weights: (packed decoder output, tokens) -> LossOutput."""
    return functools.partial(caption_loss, coverage_weight=cfg.coverage_weight, entropy_weight=cfg.entropy_weight,
                             label_smoothing=cfg.label_smoothing)
