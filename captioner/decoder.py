"""GRU decoder with Bahdanau attention over the encoder grid (Show, Attend and Tell with a GRU).

Shapes: B batch, L = H'·W' regions, D feature width, T tokens, V vocabulary,
E embedding width, H hidden width, A attention width.

Per step t, with previous word y and state h:
    context, alpha = attention(keys, features, h)            # keys = W1·features, once per image
    context = sigmoid(Linear(h)) * context                   # the gate beta (optional)
    h' = GRUCell([embed(y); context], h)
    logits = Linear(dropout([h'; context; embed(y)]))        # deep output
The initial state is tanh(Linear(pool(features))), pool = mean or attention pooling.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from captioner.attention import AttentionPool, BahdanauAttention, masked_mean
from captioner.config import DecoderConfig


@dataclass(frozen=True)
class Memory:
    """What the decoder attends to, computed once per image and constant while decoding.

    features: (B, L, D); keys: (B, L, A) = W1·features; mask: (B, L) bool (True = real region) or None.
    """

    features: Tensor
    keys: Tensor
    mask: Tensor | None = None

    def repeat_interleave(self, k: int) -> "Memory":
        """Each image's memory k times in a row: (B, ...) -> (B·k, ...), for beam search."""
        mask = None if self.mask is None else self.mask.repeat_interleave(k, dim=0)
        return Memory(self.features.repeat_interleave(k, dim=0), self.keys.repeat_interleave(k, dim=0), mask)


@dataclass(frozen=True)
class StepOutput:
    logits: Tensor  # (B, V)
    alpha: Tensor  # (B, L)
    hidden: Tensor  # (B, H)


@dataclass(frozen=True)
class DecoderOutput:
    logits: Tensor  # (B, T, V)
    alphas: Tensor  # (B, T, L)


class AttentionDecoder(nn.Module):
    """Writes a caption word by word, attending over the regions at every step."""

    def __init__(self, vocab_size: int, feature_dim: int, cfg: DecoderConfig, pad_id: int = 0) -> None:
        super().__init__()
        if cfg.init_pooling not in ("mean", "attention"):
            raise ValueError(f"decoder.init_pooling must be 'mean' or 'attention', got {cfg.init_pooling!r}")
        E, H, D, A = cfg.embed_dim, cfg.hidden_dim, feature_dim, cfg.attention_dim
        self.embedding = nn.Embedding(vocab_size, E, padding_idx=pad_id)
        self.attention = BahdanauAttention(D, H, A)
        self.gate = nn.Linear(H, D) if cfg.gate else None
        self.pool = AttentionPool(D, A) if cfg.init_pooling == "attention" else None
        self.init_h = nn.Linear(D, H)
        self.cell = nn.GRUCell(E + D, H)
        self.dropout = nn.Dropout(cfg.dropout)
        self.readout = nn.Linear(H + D + E, vocab_size)

    def memory(self, features: Tensor, mask: Tensor | None = None) -> Memory:
        """(B, L, D) features and optional (B, L) mask -> Memory with the keys precomputed."""
        return Memory(features, self.attention.keys(features), mask)

    def init_hidden(self, memory: Memory) -> Tensor:
        """Memory -> (B, H) initial state."""
        if self.pool is None:
            pooled = masked_mean(memory.features, memory.mask)  # (B, D)
        else:
            pooled = self.pool(memory.features, memory.mask)  # (B, D)
        return torch.tanh(self.init_h(pooled))  # (B, H)

    def _advance(self, emb: Tensor, hidden: Tensor, memory: Memory) -> tuple[Tensor, Tensor, Tensor]:
        """Attend with the old state, then update it. Returns new hidden (B, H), context (B, D), alpha (B, L)."""
        context, alpha = self.attention(memory.keys, memory.features, hidden, memory.mask)
        if self.gate is not None:
            context = torch.sigmoid(self.gate(hidden)) * context  # (B, D)
        hidden = self.cell(torch.cat([emb, context], dim=-1), hidden)  # (B, E + D) -> (B, H)
        return hidden, context, alpha

    def _logits(self, hidden: Tensor, context: Tensor, emb: Tensor) -> Tensor:
        """Deep output over [h; context; embedding] (..., H + D + E) -> (..., V)."""
        return self.readout(self.dropout(torch.cat([hidden, context, emb], dim=-1)))

    def step(self, tokens: Tensor, hidden: Tensor, memory: Memory) -> StepOutput:
        """One step: previous words (B,), state (B, H) -> logits (B, V), alpha (B, L), new state (B, H)."""
        emb = self.embedding(tokens)  # (B, E)
        hidden, context, alpha = self._advance(emb, hidden, memory)
        return StepOutput(self._logits(hidden, context, emb), alpha, hidden)

    def forward(
        self, features: Tensor, tokens: Tensor, mask: Tensor | None = None, sampling_prob: float = 0.0
    ) -> DecoderOutput:
        """Teacher-forced pass over padded captions.

        Args:
            features: (B, L, D) encoder grid.
            tokens: (B, T + 1) `[<start>, w1..wn, <end>, <pad>...]`; the decoder reads tokens[:, :-1].
            mask: optional (B, L) region mask, True on real regions.
            sampling_prob: probability of feeding the model's own previous prediction instead of
                the true word (scheduled sampling); 0 = pure teacher forcing.
        Returns:
            logits (B, T, V) predicting tokens[:, 1:], and alphas (B, T, L).
        """
        memory = self.memory(features, mask)
        hidden = self.init_hidden(memory)  # (B, H)
        inputs = tokens[:, :-1]  # (B, T)
        T = inputs.size(1)
        emb_all = self.embedding(inputs)  # (B, T, E)
        hiddens, contexts, alphas, step_logits = [], [], [], []
        for t in range(T):
            emb = emb_all[:, t]  # (B, E)
            if sampling_prob > 0.0 and t > 0:
                own = step_logits[-1].argmax(dim=-1)  # (B,)
                use_own = torch.rand(own.shape, device=own.device) < sampling_prob  # (B,)
                emb = torch.where(use_own.unsqueeze(-1), self.embedding(own), emb)
            hidden, context, alpha = self._advance(emb, hidden, memory)
            if sampling_prob > 0.0:
                step_logits.append(self._logits(hidden, context, emb))
            else:
                hiddens.append(hidden)
                contexts.append(context)
            alphas.append(alpha)
        if sampling_prob > 0.0:
            logits = torch.stack(step_logits, dim=1)  # (B, T, V)
        else:
            # One readout over all steps is a single large matmul instead of T small ones.
            logits = self._logits(torch.stack(hiddens, 1), torch.stack(contexts, 1), emb_all)  # (B, T, V)
        return DecoderOutput(logits, torch.stack(alphas, dim=1))  # (B, T, V), (B, T, L)
