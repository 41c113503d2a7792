"""Training loss: cross-entropy over real tokens plus two optional attention terms, the doubly
stochastic regulariser (every region looked at about once per caption) and an entropy penalty
(each word looks at few regions).

Shapes: B captions, T + 1 tokens, P real (scored) positions, V vocabulary, L regions.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from captioner.decoder import DecoderOutput


class LossOutput(NamedTuple):
    total: Tensor  # scalar: xent + alpha_reg * attention + entropy_reg * entropy
    xent: Tensor  # scalar: mean cross-entropy per real token
    attention: Tensor  # scalar: mean over captions of sum_regions (1 - sum_t alpha)^2
    entropy: Tensor  # scalar: mean entropy (nats) of the attention map of a real token


def caption_loss(
    out: DecoderOutput,
    tokens: Tensor,
    alpha_reg: float = 1.0,
    label_smoothing: float = 0.0,
    region_mask: Tensor | None = None,
    entropy_reg: float = 0.0,
) -> LossOutput:
    """Cross-entropy over real tokens + `alpha_reg * sum_regions (1 - sum_t alpha)^2` (Show, Attend and
    Tell) + `entropy_reg * mean_t H(alpha_t)`.

    Args:
        out: the decoder's packed pass: logits (P, V) and alphas (P, L), row p predicting
            tokens[out.caption[p], out.step[p] + 1]. Padding was never computed, so never counts.
        tokens: (B, T + 1) the captions the decoder read.
        alpha_reg: weight of the regulariser, which asks every region to be looked at about once
            over the caption; 0 turns it off.
        label_smoothing: passed to cross-entropy.
        region_mask: optional (B, L) bool per caption, True on real regions; padded regions are
            not penalised.
        entropy_reg: weight of the attention entropy. Penalising it asks each word to commit to
            few regions instead of blending several objects into one look; 0 turns it off.
    """
    targets = tokens[out.caption, out.step + 1]  # (P,)
    xent = F.cross_entropy(out.logits.float(), targets, label_smoothing=label_smoothing)
    B, L = tokens.size(0), out.alphas.size(-1)
    coverage = torch.zeros(B, L, device=tokens.device).index_add_(0, out.caption, out.alphas.float())  # (B, L)
    penalty = (1.0 - coverage) ** 2  # (B, L)
    if region_mask is not None:
        penalty = penalty * region_mask
    attention = penalty.sum(dim=1).mean()
    alphas = out.alphas.float()  # (P, L)
    # 0 log 0 = 0 on masked regions, with a finite gradient there (xlogy's would be infinite)
    entropy = -(alphas * alphas.clamp_min(1e-12).log()).sum(dim=-1).mean()
    return LossOutput(xent + alpha_reg * attention + entropy_reg * entropy, xent, attention, entropy)
