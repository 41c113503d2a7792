"""Bahdanau (additive) attention over the encoder's grid of regions.

Shapes: B batch, L = H'·W' regions, D feature width, H decoder hidden width, A attention width.

`e = v · tanh(W1 · features + W2 · h)`, alpha = softmax(e). The keys `W1 · features` do not
depend on the decoder state, so they are computed once per image (`keys`) and reused at every
step; recomputing them per step is most of the attention's cost in the common implementations.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


def masked_softmax(scores: Tensor, mask: Tensor | None) -> Tensor:
    """Softmax over the last dim in float32, cast back to the input dtype (safe under fp16/bf16).

    Args:
        scores: (B, L) unnormalised scores.
        mask: (B, L) bool, True where a region is real; False regions get exactly 0 weight.
    Returns:
        (B, L) weights summing to 1 over the real regions.
    """
    dtype = scores.dtype
    scores = scores.float()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).to(dtype)


class BahdanauAttention(nn.Module):
    """Additive attention: `keys(features)` once per image, then `forward(keys, features, h)` per step."""

    def __init__(self, feature_dim: int, hidden_dim: int, attention_dim: int) -> None:
        super().__init__()
        self.key_proj = nn.Linear(feature_dim, attention_dim)  # W1
        self.query_proj = nn.Linear(hidden_dim, attention_dim, bias=False)  # W2
        self.score = nn.Linear(attention_dim, 1, bias=False)  # v

    def keys(self, features: Tensor) -> Tensor:
        """(B, L, D) features -> (B, L, A) keys `W1 · features`."""
        return self.key_proj(features)

    def forward(
        self, keys: Tensor, features: Tensor, hidden: Tensor, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """One decoding step of attention.

        Args:
            keys: (B, L, A) from `keys(features)`.
            features: (B, L, D) the values.
            hidden: (B, H) decoder state.
            mask: optional (B, L) bool, True on real regions.
        Returns:
            context (B, D) and alpha (B, L), alpha summing to 1 and 0 on masked regions.
        """
        query = self.query_proj(hidden).unsqueeze(1)  # (B, 1, A)
        # v·tanh(x) = 2·v·sigmoid(2x) - sum(v), and softmax ignores the constant: these are the weights
        # of softmax(v·tanh(x)). On CPUs torch's sigmoid is ~5x faster than its tanh, and this (B, L, A)
        # nonlinearity is the costliest elementwise op of a decoder step (scripts/bench_train.py).
        scores = 2 * self.score(torch.sigmoid((keys + query).mul_(2))).squeeze(-1)  # (B, L)
        alpha = masked_softmax(scores, mask).to(features.dtype)  # (B, L)
        context = torch.bmm(alpha.unsqueeze(1), features).squeeze(1)  # (B, 1, L) @ (B, L, D) -> (B, D)
        return context, alpha


class AttentionPool(nn.Module):
    """`softmax(v · tanh(W x + b))`-weighted mean of the regions: a learned alternative to the plain mean."""

    def __init__(self, feature_dim: int, attention_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(feature_dim, attention_dim)
        self.score = nn.Linear(attention_dim, 1, bias=False)

    def forward(self, features: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L, D) features, optional (B, L) mask -> (B, D) pooled."""
        scores = self.score(torch.tanh(self.proj(features))).squeeze(-1)  # (B, L)
        weights = masked_softmax(scores, mask).to(features.dtype)  # (B, L)
        return torch.bmm(weights.unsqueeze(1), features).squeeze(1)  # (B, D)


def masked_mean(features: Tensor, mask: Tensor | None = None) -> Tensor:
    """(B, L, D) features, optional (B, L) mask -> (B, D) mean over the real regions."""
    if mask is None:
        return features.mean(dim=1)
    m = mask.unsqueeze(-1).to(features.dtype)  # (B, L, 1)
    return (features * m).sum(dim=1) / m.sum(dim=1).clamp_min(1.0)
