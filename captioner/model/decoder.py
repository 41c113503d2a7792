"""GRU decoder with Bahdanau attention over the encoder grid (Show, Attend and Tell with a GRU).

Shapes: B batch, L = H'·W' regions, D feature width, T tokens, V vocabulary,
E embedding width, H hidden width, A attention width.

Per step t, with previous word y and state h (attend "before", the default):
    alpha = attention(keys, h); context = alpha · features    # keys = W1·features, once per image
    context = sigmoid(Linear(h)) * context                   # the gate beta (optional)
    h' = GRUCell([embed(y); context], h)
    logits = Linear(dropout([h'; context; embed(y)]))        # deep output
The initial state is tanh(Linear(pool(features))) with pool = the mean or an attention pooling of
the regions (`init_pooling`), or zeros (`init_pooling: none`): then everything the decoder knows
of the image comes through attention.

With attend "after" the word is read before looking (the top-down order of Anderson et al. 2018),
so the query knows which word was just written; the GRU reads the previous step's context c:
    h' = GRUCell([embed(y); c], h)
    alpha = attention(keys, h'); context = alpha · features   # gated by sigmoid(Linear(h'))
    logits = Linear(dropout([h'; context; embed(y)]))
and the state carried between steps is [h'; context] (B, H + D), c = 0 at the first step.

With `global_context` the GRU also reads the grid's mean at every step (the mean-pooled image
feature of Up-Down, Anderson et al. 2018): what the photo is about is always at hand, so attention
need only say *where*, and nothing asks a map to spread over the scene to carry it.

With `concepts` a linear word detector scores every region of the encoder's grid for every word
of the vocabulary (multiple-instance learning from the captions alone, Fang et al. 2015: a word is
in a photo's captions when some region shows it). Training pulls the attention of the step that
writes a content word towards where its detector fires (`train.concept_weight`); the decoder never
reads the detector, so the maps stay what the decoder used; decoding may add a content word's
photo-level log-probability to its score (`word_log_probs`, `decode.detector_weight`).

Before all of this, once per image, the regions are projected from the encoder's width to
`feature_dim` (ReLU(Linear)) and given learned row + column embeddings. CNN features say *what*
is in a region but hardly *where* it is; with the position term the query can ask for "the
leftmost object", which captions that order objects in space need. On a two-scale grid both
per-region maps (the projection, the word detector) multiply the channels each 2x2 block of cells
shares once per block (`RegionLinear`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from captioner.config import DecoderConfig
from captioner.model.attention import AttentionPool, BahdanauAttention
from captioner.model.concepts import INITIAL_DETECTOR_BIAS, noisy_or
from captioner.model.memory import Memory
from captioner.model.regions import RegionLinear


@dataclass(frozen=True)
class StepOutput:
    logits: Tensor  # (B, V)
    alpha: Tensor  # (B, L)
    hidden: Tensor  # the new state: (B, H), or (B, H + D) [h; context] with attend "after"


@dataclass(frozen=True)
class DecoderOutput:
    """A teacher-forced pass over B captions, packed: only the P real positions (words + <end> of
    every caption, no padding) are computed, in time-major order.

    logits: (P, V); alphas: (P, L); caption: (P,) int64 index of the caption (0..B-1) and
    step: (P,) int64 position t of each row, so row p predicts tokens[caption[p], step[p] + 1].
    rows: (B,) int64 the image (row of the batch's grids) of each caption.
    concepts: (N, L, K) the word detector's score of every region for the K outputs in `detected`,
        or None.
    grid: (N, L, D_enc) the encoder grids the pass read (for teachers that look at them).
    detected: (K,) int64 the detector outputs `concepts` holds, ascending; None = all V.
    """

    logits: Tensor
    alphas: Tensor
    caption: Tensor
    step: Tensor
    rows: Tensor | None = None
    concepts: Tensor | None = None
    grid: Tensor | None = None
    detected: Tensor | None = None

    def padded(self, x: Tensor, batch: int, steps: int) -> Tensor:
        """Packed (P, ...) -> (batch, steps, ...) with zeros at the padded positions."""
        out = x.new_zeros(batch, steps, *x.shape[1:])
        out[self.caption, self.step] = x
        return out


class AttentionDecoder(nn.Module):
    """Writes a caption word by word, attending over the regions at every step."""

    def __init__(self, vocab_size: int, feature_dim: int, cfg: DecoderConfig, grid: tuple[int, int] | None = None,
                 pad_id: int = 0, block_dim: int = 0) -> None:
        """
        Args:
            vocab_size: V.
            feature_dim: the encoder's region width.
            cfg: widths and options.
            grid: (H', W') of the encoder's grid; needed when cfg.position is on.
            pad_id: the <pad> token id.
            block_dim: the trailing channels of the grid each 2x2 block of cells shares (the last stage's
                on a two-scale grid: `Encoder.block_dim`); 0 = none.
        """
        super().__init__()
        if cfg.position and grid is None:
            raise ValueError("decoder.position needs the encoder's grid (H', W')")
        D = cfg.feature_dim or feature_dim
        E, H, A = cfg.embed_dim, cfg.hidden_dim, cfg.attention_dim
        self.grid = tuple(grid) if grid is not None else None
        regions = dict(grid=self.grid, block_dim=block_dim)
        self.project = nn.Sequential(RegionLinear(feature_dim, D, **regions), nn.ReLU()) if cfg.feature_dim else None
        if cfg.position:
            self.row_embedding = nn.Parameter(torch.zeros(grid[0], D))  # (H', D)
            self.col_embedding = nn.Parameter(torch.zeros(grid[1], D))  # (W', D)
            nn.init.normal_(self.row_embedding, std=0.02)
            nn.init.normal_(self.col_embedding, std=0.02)
        else:
            self.row_embedding = self.col_embedding = None
        self.embedding = nn.Embedding(vocab_size, E, padding_idx=pad_id)
        self.attention = BahdanauAttention(D, H, A)
        self.gate = nn.Linear(H, D) if cfg.gate else None
        self.hidden_dim = H
        self.pool = AttentionPool(D, A) if cfg.init_pooling == "attention" else None
        # No initial-state layer with init_pooling "none": a parameter that never gets a gradient
        # would stop DDP at its second step.
        self.init_h = nn.Linear(D, H) if cfg.init_pooling != "none" else None
        self.attend_after = cfg.attend == "after"
        self.global_context = cfg.global_context
        self.cell = nn.GRUCell(E + D + (D if cfg.global_context else 0), H)
        self.concepts = RegionLinear(feature_dim, vocab_size, **regions) if cfg.concepts else None
        if self.concepts is not None:
            nn.init.constant_(self.concepts.bias, INITIAL_DETECTOR_BIAS)
            # (V,) the detector output standing for each word (`concepts.concept_slots`: grouped words share
            # one), saved with the weights: a model fine-tuned from this one reads its detector the same way
            self.register_buffer("detector_slots", torch.arange(vocab_size))
        self.dropout = nn.Dropout(cfg.dropout)
        self.readout = nn.Linear(H + D + E, vocab_size)

    def memory(self, features: Tensor) -> Memory:
        """(B, L, D_enc) encoder features -> Memory: the regions projected and placed (B, L, D) and
        their keys (B, L, A), computed once per image."""
        if self.project is not None:
            features = self.project(features)  # (B, L, D_enc) -> (B, L, D)
        if self.row_embedding is not None:
            H_, W_ = self.grid
            if features.size(1) != H_ * W_:
                raise ValueError(f"decoder built for a {H_}x{W_} grid got {features.size(1)} regions")
            position = (self.row_embedding[:, None] + self.col_embedding[None, :]).reshape(H_ * W_, -1)  # (L, D)
            features = features + position.to(features.dtype)  # (B, L, D)
        scene = features.mean(dim=1) if self.global_context else None  # (B, D)
        return Memory(features, self.attention.keys(features), scene)

    def init_hidden(self, memory: Memory) -> Tensor:
        """Memory -> (B, H) initial state (zeros with init_pooling 'none': then everything the
        decoder knows of the image comes through attention); with attend "after", (B, H + D) with
        a zero context."""
        if self.init_h is None:
            hidden = memory.features.new_zeros(memory.features.size(0), self.hidden_dim)  # (B, H)
        else:
            pooled = memory.features.mean(dim=1) if self.pool is None else self.pool(memory.features)  # (B, D)
            hidden = torch.tanh(self.init_h(pooled))  # (B, H)
        if self.attend_after:
            hidden = torch.cat([hidden, torch.zeros_like(memory.features[:, 0])], dim=-1)  # (B, H + D)
        return hidden

    def _advance(self, emb: Tensor, state: Tensor, memory: Memory) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Attend and update the state, in the order `attend` says. Returns the new state (B, H) or
        (B, H + D), the new h (B, H) for the readout, context (B, D), alpha (B, L)."""
        scene = [memory.mean()] if self.global_context else []  # (B, D): the grid's mean
        if self.attend_after:
            hidden, previous = state.split([self.hidden_dim, state.size(-1) - self.hidden_dim], -1)  # (B, H), (B, D)
            hidden = self.cell(torch.cat([emb, previous, *scene], dim=-1), hidden)  # (B, E + D [+ D]) -> (B, H)
        else:
            hidden = state  # (B, H)
        alpha = self.attention(memory.keys, hidden)  # (B, L)
        context = memory.read(alpha)  # (B, D)
        if self.gate is not None:
            context = torch.sigmoid(self.gate(hidden)) * context  # (B, D)
        if self.attend_after:
            return torch.cat([hidden, context], dim=-1), hidden, context, alpha  # state (B, H + D)
        hidden = self.cell(torch.cat([emb, context, *scene], dim=-1), hidden)  # (B, E + D [+ D]) -> (B, H)
        return hidden, hidden, context, alpha

    def _logits(self, hidden: Tensor, context: Tensor, emb: Tensor) -> Tensor:
        """Deep output over [h; context; embedding] (..., H + D + E) -> (..., V)."""
        return self.readout(self.dropout(torch.cat([hidden, context, emb], dim=-1)))

    def step(self, tokens: Tensor, state: Tensor, memory: Memory) -> StepOutput:
        """One step: previous words (B,), state (B, H) or (B, H + D) (see `init_hidden`) ->
        logits (B, V), alpha (B, L), the new state."""
        emb = self.embedding(tokens)  # (B, E)
        state, hidden, context, alpha = self._advance(emb, state, memory)
        return StepOutput(self._logits(hidden, context, emb), alpha, state)

    def forward(
        self, features: Tensor, tokens: Tensor, lengths: Tensor, rows: Tensor | None = None,
        sampling_prob: float = 0.0, detect: bool | Tensor = True,
    ) -> DecoderOutput:
        """Teacher-forced pass over a batch of captions, packed (see `DecoderOutput`).

        The region projection and the keys run once per image, however many of its captions the
        batch holds, and an image's captions read its features together (`Memory.packed`). The
        captions are sorted longest first, so at step t the captions still going are the first n_t
        rows and the step runs on those alone: padding costs nothing.

        Args:
            features: (N, L, D_enc) grids of the batch's N distinct images.
            tokens: (B, T + 1) `[<start>, w1..wn, <end>, <pad>...]`; the decoder reads tokens[:, :-1].
            lengths: (B,) scored positions per caption (words + <end>), at least 1.
            rows: (B,) int64 row of `features` for each caption; None = caption b is image b.
            sampling_prob: probability of feeding the model's own previous prediction instead of
                the true word (scheduled sampling); 0 = pure teacher forcing.
            detect: which word detector outputs to score (`concepts`, for the cross-entropy loss's
                concept terms): True = all V, a (K,) ascending int64 tensor = those (the batch's
                words and a sample of others: `CaptionCriterion.detector_outputs`), False = none,
                where nothing reads them (self-critical training). All of them at 12x12 regions and
                a 2,500-word vocabulary is a (N·144, 1280) x (1280, 2500) product per pass.
        """
        lengths = lengths.to(tokens.device)
        rows = torch.arange(len(tokens), device=tokens.device) if rows is None else rows.to(tokens.device)
        order = torch.argsort(lengths, descending=True, stable=True)  # (B,) longest caption first
        sizes = (lengths[order].unsqueeze(1) > torch.arange(int(lengths.max()), device=lengths.device))
        sizes = sizes.sum(0).tolist()  # n_t: captions still going at step t, non-increasing
        image_memory = self.memory(features)  # (N, L, D), (N, L, A): once per image
        state = self.init_hidden(image_memory)[rows[order]]  # (B, H) or (B, H + D)
        emb_all = self.embedding(tokens[order, : len(sizes)])  # (B, T, E)
        memories = image_memory.packed(rows[order], sizes)  # per step t: keys (n_t, L, A), the images' features
        hiddens, contexts, embs, alphas, step_logits = [], [], [], [], []
        for t, n in enumerate(sizes):
            emb = emb_all[:n, t]  # (n, E)
            if sampling_prob > 0.0 and t > 0:
                own = step_logits[-1][:n].argmax(dim=-1)  # (n,)
                use_own = torch.rand(own.shape, device=own.device) < sampling_prob  # (n,)
                emb = torch.where(use_own.unsqueeze(-1), self.embedding(own), emb)
            state, hidden, context, alpha = self._advance(emb, state[:n], memories[t])  # h (n, H), (n, D), (n, L)
            if sampling_prob > 0.0:
                step_logits.append(self._logits(hidden, context, emb))  # (n, V)
            else:
                hiddens.append(hidden)
                contexts.append(context)
                embs.append(emb)
            alphas.append(alpha)
        if sampling_prob > 0.0:
            logits = torch.cat(step_logits)  # (P, V)
        else:
            # One readout over all positions is a single large matmul instead of T small ones.
            logits = self._logits(torch.cat(hiddens), torch.cat(contexts), torch.cat(embs))  # (P, V)
        caption = torch.cat([order[:n] for n in sizes])  # (P,)
        step = torch.cat([torch.full((n,), t, dtype=torch.long, device=order.device) for t, n in enumerate(sizes)])
        concepts, detected = self._detect(features, detect)  # (N, L, K), (K,)
        return DecoderOutput(logits, torch.cat(alphas), caption, step, rows, concepts, features, detected)

    @property
    def detects_words(self) -> bool:
        """The decoder has a word detector (`word_log_probs`)."""
        return self.concepts is not None

    def word_log_probs(self, features: Tensor) -> Tensor:
        """(B, L, D_enc) encoder grids -> (B, V) float32 log p(the photo shows word w): the word
        detector's noisy-OR over the regions, read at each word's output (`detector_slots`)."""
        outputs, column = self.word_outputs()
        log_present, _ = noisy_or(self._detect(features, outputs)[0])  # (B, K)
        return log_present[:, column]  # (B, V)

    def word_outputs(self) -> tuple[Tensor, Tensor]:
        """The detector outputs the words read, (K,) ascending (a group's words share one), and each
        word's position among them, (V,)."""
        if self.concepts is None:
            raise ValueError("this decoder has no word detector (model.decoder.concepts)")
        outputs = torch.unique(self.detector_slots)  # (K,)
        return outputs, torch.searchsorted(outputs, self.detector_slots)

    def _detect(self, features: Tensor, detect: bool | Tensor) -> tuple[Tensor | None, Tensor | None]:
        """The word detector's scores (N, L, K) of the outputs `detect` names (see `forward`), and
        those outputs (K,) (None: all V)."""
        if self.concepts is None or detect is False:
            return None, None
        if detect is True:
            return self.concepts(features), None  # (N, L, V)
        ids = detect.to(features.device)  # (K,)
        return self.concepts(features, ids), ids  # (N, L, K)
