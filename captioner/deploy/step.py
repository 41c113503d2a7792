"""The decoder's memory, step and word detector rewritten for inference graphs: the same function, less
work a word.

`AttentionDecoder.step` is written for training (one module per idea, a readout over the concatenated
[h; context; embedding]). Exported as it is, a beam-search step at 160 rows spends most of its time
in the readout matmul and the attention's elementwise passes. Three exact rewrites remove part of it:

- Token tables. Whatever depends on the previous word alone is a row lookup: the GRU's input gates
  take `W_ih[:, :E] · embed(y) + b_ih` from a (V, 3H) table, and the readout's embedding part
  `W_r[:, H+D:] · embed(y) + b_r` from a (V, V) table (built only while V <= READOUT_TABLE_MAX_VOCAB:
  V² floats; above it the readout multiplies the embedding as before).
- Doubled weights. The attention weights are softmax(2·v·sigmoid(keys + 2·W2·h)), the keys being
  2·W1·features (see `BahdanauAttention`); the step stores 2·W2 and 2·v. Doubling is exact in
  floating point.
- The GRU cell written out (r, z, n gates as torch's GRUCell computes them), so its input half can
  start from the table.

Only summation order changes: the graphs match the torch decoder to ~1e-6 (export checks 1e-4).
Shapes: R rows, L regions, D feature width, A attention width, E embedding width, H hidden width,
V vocabulary.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from captioner.model.concepts import noisy_or
from captioner.model.decoder import AttentionDecoder

READOUT_TABLE_MAX_VOCAB = 4096  # a (V, V) float32 table: 64 MiB at 4096 words


def _frozen(x: Tensor) -> nn.Parameter:
    return nn.Parameter(x.detach().clone(), requires_grad=False)


class InferenceMemory(nn.Module):
    """grid (B, L, D_enc) -> features (B, L, D), keys (B, L, A) = 2·W1·features, initial state (B, S_h)."""

    def __init__(self, decoder: AttentionDecoder) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, grid: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        memory = self.decoder.memory(grid)
        return memory.features, memory.keys, self.decoder.init_hidden(memory)


class InferenceWords(nn.Module):
    """grid (B, L, D_enc) -> (B, V) log p(the photo shows each word): `AttentionDecoder.word_log_probs`,
    with the detector's rows of the outputs the words read taken once (a group's words share one)."""

    def __init__(self, decoder: AttentionDecoder) -> None:
        super().__init__()
        with torch.no_grad():
            outputs, column = decoder.word_outputs()  # (K,), (V,) word -> k
            self.weight = _frozen(decoder.concepts.weight[outputs])  # (K, D_enc)
            self.bias = _frozen(decoder.concepts.bias[outputs])  # (K,)
            self.register_buffer("column", column)

    def forward(self, grid: Tensor) -> Tensor:
        log_present, _ = noisy_or(grid @ self.weight.T + self.bias)  # (B, K)
        return log_present[:, self.column]  # (B, V)


class InferenceStep(nn.Module):
    """tokens (R,), state (R, S_h), features (R, L, D), keys (R, L, A) -> logits (R, V),
    alpha (R, L), new state (R, S_h): `AttentionDecoder.step` of an eval-mode decoder.

    `tables` False: no token tables (the embedding is multiplied as the decoder does), for a small
    graph holding only the decoder's own weights (`export --small`)."""

    def __init__(self, decoder: AttentionDecoder, tables: bool = True) -> None:
        super().__init__()
        d = decoder
        H, E = d.hidden_dim, d.embedding.embedding_dim
        table = d.embedding.weight  # (V, E)
        w_ih, w_r = d.cell.weight_ih, d.readout.weight  # (3H, E + D), (V, H + D + E)
        self.hidden_dim, self.attend_after = H, d.attend_after
        with torch.no_grad():
            D = d.attention.key_proj.in_features
            if tables:
                self.gates_of_token = _frozen(table @ w_ih[:, :E].T + d.cell.bias_ih)  # (V, 3H)
                self.token_embedding = self.w_ih_token = self.b_ih = None
            else:
                self.gates_of_token = None
                self.token_embedding, self.w_ih_token = _frozen(table), _frozen(w_ih[:, :E])  # (V, E), (3H, E)
                self.b_ih = _frozen(d.cell.bias_ih)  # (3H,)
            self.w_ih_context = _frozen(w_ih[:, E : E + D])  # (3H, D)
            # with global_context the GRU also reads the grid's mean: (3H, D), else None
            self.w_ih_scene = _frozen(w_ih[:, E + D :]) if d.global_context else None
            self.w_hh, self.b_hh = _frozen(d.cell.weight_hh), _frozen(d.cell.bias_hh)  # (3H, H), (3H,)
            self.query = _frozen(2 * d.attention.query_proj.weight)  # (A, H)
            self.score = _frozen(2 * d.attention.score.weight.T)  # (A, 1)
            self.gated = d.gate is not None
            if self.gated:
                self.gate_w, self.gate_b = _frozen(d.gate.weight), _frozen(d.gate.bias)  # (D, H), (D,)
            self.w_r_state = _frozen(w_r[:, : w_r.size(1) - E])  # (V, H + D) over [h'; context]
            if tables and table.size(0) <= READOUT_TABLE_MAX_VOCAB:
                self.readout_of_token = _frozen(table @ w_r[:, -E:].T + d.readout.bias)  # (V, V)
                self.embedding = self.w_r_token = self.b_r = None
            else:
                self.readout_of_token = None
                self.embedding, self.w_r_token = _frozen(table), _frozen(w_r[:, -E:])  # (V, E), (V, E)
                self.b_r = _frozen(d.readout.bias)  # (V,)

    def _attend(self, hidden: Tensor, features: Tensor, keys: Tensor) -> tuple[Tensor, Tensor]:
        """(R, H) query -> gated context (R, D), alpha (R, L)."""
        query2 = (hidden @ self.query.T).unsqueeze(1)  # (R, 1, A): 2·W2·h
        # (R, L, A) @ (A, 1): ONNX Runtime's MatMul against a vector is ~8x slower than against a matrix
        scores = (torch.sigmoid(keys + query2) @ self.score).squeeze(-1)  # (R, L): 2·v·sigmoid(keys + 2·W2·h)
        alpha = torch.softmax(scores, dim=-1)  # (R, L)
        context = torch.bmm(alpha.unsqueeze(1), features).squeeze(1)  # (R, D)
        if self.gated:
            context = torch.sigmoid(hidden @ self.gate_w.T + self.gate_b) * context
        return context, alpha

    def _gru(self, tokens: Tensor, inputs: Tensor, hidden: Tensor, features: Tensor) -> Tensor:
        """torch's GRUCell on [embed(token); inputs (; mean of features)] with the embedding part from the table."""
        if self.gates_of_token is not None:
            x = self.gates_of_token[tokens] + inputs @ self.w_ih_context.T  # (R, 3H)
        else:
            x = self.token_embedding[tokens] @ self.w_ih_token.T + self.b_ih + inputs @ self.w_ih_context.T  # (R, 3H)
        if self.w_ih_scene is not None:
            x = x + features.mean(dim=1) @ self.w_ih_scene.T  # (R, D) @ (D, 3H)
        h = hidden @ self.w_hh.T + self.b_hh  # (R, 3H)
        x_r, x_z, x_n = x.chunk(3, dim=-1)
        h_r, h_z, h_n = h.chunk(3, dim=-1)
        r, z = torch.sigmoid(x_r + h_r), torch.sigmoid(x_z + h_z)
        n = torch.tanh(x_n + r * h_n)
        return (1 - z) * n + z * hidden  # (R, H)

    def forward(self, tokens: Tensor, state: Tensor, features: Tensor, keys: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.attend_after:
            hidden, previous = state.split([self.hidden_dim, state.size(-1) - self.hidden_dim], -1)  # (R, H), (R, D)
            hidden = self._gru(tokens, previous, hidden, features)
            context, alpha = self._attend(hidden, features, keys)
            new_state = torch.cat([hidden, context], dim=-1)  # (R, H + D)
        else:
            context, alpha = self._attend(state, features, keys)
            hidden = new_state = self._gru(tokens, context, state, features)  # (R, H)
        logits = torch.cat([hidden, context], dim=-1) @ self.w_r_state.T  # (R, V)
        if self.readout_of_token is not None:
            logits = logits + self.readout_of_token[tokens]
        else:
            logits = logits + self.embedding[tokens] @ self.w_r_token.T + self.b_r
        return logits, alpha, new_state
