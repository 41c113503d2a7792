"""Teacher forcing at inference: where would the model look, and how likely is each word, for a
caption it is *given* (a user's phrasing, or a reference caption for the attention-correctness
protocol of Liu et al. 2017)?

Shapes: B captions, N images, T words (+ <end>), L = H'·W' regions, V vocabulary.

Runs the decoder step by step as beam search does (eval mode, `memory` once per image, `step`),
so it works for any decoder with that interface: the torch `AttentionDecoder`, an ensemble, and
the ONNX Runtime decoder alike. `text_ids` reads a user's text (every word must be one the model
knows) and `force_text` scores it on each image as the `Hypothesis` a search would have returned.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from captioner.data.vocab import Vocabulary
from captioner.decoding.search import Hypothesis, length_penalty
from captioner.decoding.text import TextError, text_ids  # noqa: F401 (re-exported: text_ids reads the text to force)
from captioner.model.decoder import AttentionDecoder
from captioner.model.memory import Memory


@dataclass(frozen=True)
class Forced:
    """A teacher-forced pass over B captions.

    logprobs: (B, T + 1) log-probability of each word and of <end> after the last one; 0 past a
        caption's length.
    alphas: (B, T + 1, L) the attention of the step that predicted each of them (zeros past the end).
    lengths: (B,) words + 1 (<end>) per caption.
    """

    logprobs: Tensor
    alphas: Tensor
    lengths: Tensor


def forced_steps(decoder: AttentionDecoder, memory: Memory, state: Tensor, tokens: Tensor,
                 steps: int) -> tuple[list[Tensor], list[Tensor]]:
    """Feed tokens[:, t] for t < `steps` (gradients as the caller's mode has them): per step, the
    log-probability of tokens[:, t + 1] (B,) and the map it was predicted with (B, L)."""
    logprobs, alphas = [], []
    for t in range(steps):
        out = decoder.step(tokens[:, t], state, memory)  # logits (B, V), alpha (B, L)
        logp = torch.log_softmax(out.logits.float(), dim=-1)  # (B, V)
        logprobs.append(logp.gather(1, tokens[:, t + 1 : t + 2]).squeeze(1))  # (B,)
        alphas.append(out.alpha.float())  # (B, L)
        state = out.hidden
    return logprobs, alphas


@torch.no_grad()
def teacher_force(decoder: AttentionDecoder, features: Tensor, tokens: Tensor, lengths: Tensor,
                  rows: Tensor | None = None) -> Forced:
    """Feed the given captions to the decoder and read off each word's log-probability and map.

    Args:
        decoder: in eval mode (dropout off).
        features: (N, L, D) encoder grids.
        tokens: (B, T + 2) `[<start>, w1..wn, <end>, <pad>...]` word ids.
        lengths: (B,) scored positions per caption (words + <end>), at least 1.
        rows: (B,) int64 row of `features` for each caption; None = caption b is image b.
    Returns:
        Forced: step t's log-probability of tokens[:, t + 1] and the map it was predicted with.
    """
    B, device = tokens.size(0), features.device
    rows = torch.arange(B, device=device) if rows is None else rows.to(device)
    memory = decoder.memory(features)  # (N, L, D), (N, L, A): once per image
    state = decoder.init_hidden(memory)[rows]  # (B, H) or (B, H + D)
    memory = memory.select(rows)  # (B, L, D), (B, L, A)
    tokens, lengths = tokens.to(device, torch.long), lengths.to(device)  # int64: gather's and the ONNX graph's
    steps = int(lengths.max())
    logprobs, alphas = forced_steps(decoder, memory, state, tokens, steps)
    live = torch.arange(steps, device=device)[None, :] < lengths[:, None]  # (B, T + 1)
    # `where`, not a product: a padded position scored -inf (a <pad> the model never gives) would be NaN.
    logprobs_ = torch.where(live, torch.stack(logprobs, 1), 0.0)  # (B, T + 1)
    alphas_ = torch.where(live[..., None], torch.stack(alphas, 1), 0.0)  # (B, T + 1, L)
    return Forced(logprobs_, alphas_, lengths)


def force_text(decoder: AttentionDecoder, features: Tensor, ids: Sequence[int], vocab: Vocabulary,
               exponent: float) -> list[Hypothesis]:
    """The words `ids` (from `text_ids`) forced on each of the (N, L, D) grids, as N finished
    Hypotheses: logprob sums the words' and <end>'s, score is length-penalised as beam search's
    (`exponent`), alphas (T, L) the maps the words were predicted with, word_logprobs (T,)."""
    N, T = features.size(0), len(ids)
    tokens = torch.tensor([vocab.start_id, *ids, vocab.end_id]).expand(N, T + 2)  # (N, T + 2) one caption each
    forced = teacher_force(decoder, features, tokens, torch.full((N,), T + 1))
    hypotheses = []
    for logprobs, alphas in zip(forced.logprobs.tolist(), forced.alphas):  # (T + 1,), (T + 1, L)
        logprob = sum(logprobs)
        hypotheses.append(Hypothesis(list(ids), logprob, logprob / length_penalty(T + 1, exponent), alphas[:T],
                                     True, logprobs[:T]))
    return hypotheses
