"""Bahdanau (additive) attention over the encoder's grid of regions.

Shapes: B batch, L = H'·W' regions, D feature width, H decoder hidden width, A attention width.

`e = v · tanh(W1 · features + W2 · h)`, alpha = softmax(e) over the L regions. The keys
`W1 · features` do not depend on the decoder state, so they are computed once per image (`keys`)
and reused at every step; recomputing them per step is most of the attention's cost in the common
implementations. Every encoder gives a full grid, so no region is ever padding.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


def softmax_float32(scores: Tensor) -> Tensor:
    """Softmax over the last dim in float32, whatever the scores' dtype: the attention weights stay
    float32 under fp16/bf16 autocast, so a map sums to 1 (to 1e-6, not bf16's 1e-2) in the loss's
    coverage and entropy terms, in beam search's history and in the pictures.

    Args:
        scores: (B, L) unnormalised scores, any float dtype.
    Returns:
        (B, L) float32 weights summing to 1.
    """
    return torch.softmax(scores.float(), dim=-1)


class BahdanauAttention(nn.Module):
    """Additive attention: `keys(features)` once per image, then `forward(keys, h)` per step -> the map."""

    def __init__(self, feature_dim: int, hidden_dim: int, attention_dim: int) -> None:
        super().__init__()
        self.key_proj = nn.Linear(feature_dim, attention_dim)  # W1
        self.query_proj = nn.Linear(hidden_dim, attention_dim, bias=False)  # W2
        self.score = nn.Linear(attention_dim, 1, bias=False)  # v

    def keys(self, features: Tensor) -> Tensor:
        """(B, L, D) features -> (B, L, A) keys `W1 · features`."""
        return self.key_proj(features)

    def forward(self, keys: Tensor, hidden: Tensor) -> Tensor:
        """One decoding step's map (the context it reads: `Memory.read`).

        Args:
            keys: (B, L, A) from `keys(features)`.
            hidden: (B, H) decoder state.
        Returns:
            alpha (B, L) float32, summing to 1.
        """
        query = self.query_proj(hidden).unsqueeze(1)  # (B, 1, A)
        # v·tanh(x) = 2·v·sigmoid(2x) - sum(v), and softmax ignores the constant: these are the weights
        # of softmax(v·tanh(x)). On CPUs torch's sigmoid is ~5x faster than its tanh, and this (B, L, A)
        # nonlinearity is the costliest elementwise op of a decoder step (scripts/bench_train.py).
        scores = 2 * self.score(torch.sigmoid((keys + query).mul_(2))).squeeze(-1)  # (B, L)
        return softmax_float32(scores)  # (B, L) float32


class AttentionPool(nn.Module):
    """`softmax(v · tanh(W x + b))`-weighted mean of the regions: a learned alternative to the plain mean."""

    def __init__(self, feature_dim: int, attention_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(feature_dim, attention_dim)
        self.score = nn.Linear(attention_dim, 1, bias=False)

    def forward(self, features: Tensor) -> Tensor:
        """(B, L, D) features -> (B, D) pooled."""
        scores = self.score(torch.tanh(self.proj(features))).squeeze(-1)  # (B, L)
        weights = softmax_float32(scores).to(features.dtype)  # (B, L)
        return torch.bmm(weights.unsqueeze(1), features).squeeze(1)  # (B, D)
