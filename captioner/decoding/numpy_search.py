"""Beam search in numpy over a step function: `captioner.decoding.search` without torch.

The ONNX runtime without torch (`captioner.deploy.lite`) drives step.onnx with this. It is the torch
search step for step, so the two return the same hypotheses (scores to float32 rounding):

- the memory once per image, expanded to B·K rows; only beam 0 live at the start;
- float32 log-softmax over the whole vocabulary, banned ids at -inf after it (<end> too before
  `min_length` words), repeated n-grams blocked, no <end> right after a function word, the `once`
  ids (content words) not written twice;
- one top-2K over each image's (K·V) candidates, beam = idx // V, token = idx % V; an <end> among
  the top K is a finished hypothesis scored logprob / length**penalty; the best K others go on;
- with `decode.detector_weight` w, each image's logits gain w · log p(the photo shows the word) for
  the content words before the log-softmax (`word_bias`);
- an image is done with K finished hypotheses (fairseq's rule: K = 1 is greedy) and leaves the
  batch; after `max_length` words one more step may only end; an image none of whose beams ended
  returns its best live beams, unfinished.

Shapes: B images, n images still searched, K beams, R = n·K rows, L regions, D feature width,
A attention width, S state width, V vocabulary, t words so far.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from captioner.config import DecodeConfig
from captioner.data.vocab import Vocabulary

NEG_INF = np.float32(-np.inf)
# tokens (R,) int64, state (R, S), features (R, L, D), keys (R, L, A) -> logits (R, V), alpha (R, L), state (R, S)
Step = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Hypothesis:
    """One decoded caption, as `search.Hypothesis` with its maps in numpy.

    tokens: word ids, without <start>/<end>; logprob: their summed log-probability (and <end>'s when
    finished); score: logprob / length_penalty(len(tokens) + finished); alphas: (len(tokens), L)
    float32; finished: False when cut at max_length; word_logprobs: each word's log-probability, for
    a caption given as text (`force_text`).
    """

    tokens: list[int]
    logprob: float
    score: float
    alphas: np.ndarray
    finished: bool
    word_logprobs: list[float] | None = None


def length_penalty(length: int, exponent: float) -> float:
    """`length ** exponent`, length counting <end> when reached, at least 1 (as `search.length_penalty`)."""
    return float(max(length, 1)) ** exponent


def _hypothesis(tokens: list[int], logprob: float, alphas: np.ndarray, finished: bool, exponent: float) -> Hypothesis:
    score = logprob / length_penalty(len(tokens) + int(finished), exponent)
    return Hypothesis(tokens, logprob, score, alphas, finished)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(R, V) -> (R, V) float32 log-probabilities."""
    x = logits.astype(np.float32, copy=False)
    shifted = x - x.max(axis=1, keepdims=True)  # (R, V)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def block_repeated_ngrams(logp: np.ndarray, words: np.ndarray, n: int) -> np.ndarray:
    """Set to -inf, in place, every token that would repeat an n-gram already in a row's words
    (logp (R, V), words (R, t)); n = 1: no word twice."""
    t = words.shape[1]
    if n <= 0 or t < n:  # no complete n-gram yet
        return logp
    windows = np.lib.stride_tricks.sliding_window_view(words, n, axis=1)  # (R, W, n), W = t - n + 1
    if n == 1:
        match = np.ones(windows.shape[:2], dtype=bool)  # (R, W)
    else:
        match = (windows[:, :, :-1] == words[:, None, t - n + 1 :]).all(axis=-1)  # (R, W) prefix = last n-1 words
    rows, starts = np.nonzero(match)
    logp[rows, windows[rows, starts, -1]] = NEG_INF
    return logp


def block_repeated_words(logp: np.ndarray, words: np.ndarray, once: np.ndarray) -> np.ndarray:
    """Set to -inf, in place, every word of a row's words (R, t) that `once` (V,) bool allows only
    once per caption, in logp (R, V) (as `search.block_repeated_words`)."""
    rows, cols = np.nonzero(once[words])  # positions of once-only words already written
    logp[rows, words[rows, cols]] = NEG_INF
    return logp


def _top(cand: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best of each row of (n, K·V), best first (the lower index first on ties): scores, indices."""
    idx = np.argpartition(-cand, k - 1, axis=1)[:, :k] if k < cand.shape[1] else np.tile(np.arange(k), (len(cand), 1))
    vals = np.take_along_axis(cand, idx, axis=1)  # (n, k)
    order = np.lexsort((idx, -vals), axis=1)  # by score descending, then index
    return np.take_along_axis(vals, order, axis=1), np.take_along_axis(idx, order, axis=1)


@dataclass
class _Beams:
    """The live rows of the search: R = n·K, image `ids[b]` on rows b·K .. b·K + K - 1."""

    ids: list[int]  # (n,) input index of each image still searched
    tokens: np.ndarray  # (R,) int64 the last word of each row
    state: np.ndarray  # (R, S)
    features: np.ndarray  # (R, L, D)
    keys: np.ndarray  # (R, L, A)
    scores: np.ndarray  # (n, K) float32 summed log-probs
    bias: np.ndarray | None  # (n, V) float32 added to each image's logits (`word_bias`), or None
    words: np.ndarray  # (R, t) int64
    history: np.ndarray  # (R, t, L) float32 maps

    def keep(self, going: list[int], K: int) -> np.ndarray:
        """Drop the images not in `going` (positions in `ids`); returns the kept rows."""
        rows = (np.asarray(going)[:, None] * K + np.arange(K)).reshape(-1)  # (n'·K,)
        self.ids = [self.ids[b] for b in going]
        self.bias = None if self.bias is None else self.bias[going]
        self.features, self.keys = self.features[rows], self.keys[rows]
        self.words, self.history = self.words[rows], self.history[rows]
        return rows


class _Rules:
    """What the search may write next (as `rules.Rules`): never a banned id; <end> not before
    `min_length` words nor right after a `no_end_after` id; no repeated `no_repeat_ngram`-gram; the
    `once` ids at most once per caption."""

    def __init__(self, banned_ids: Sequence[int], end_id: int, min_length: int, no_repeat_ngram: int,
                 no_end_after: Sequence[int], once: Sequence[int]) -> None:
        self.banned = np.asarray(list(banned_ids), dtype=np.int64)
        self.end_id, self.min_length, self.no_repeat_ngram = end_id, min_length, no_repeat_ngram
        self.no_end_after, self.once_ids = list(no_end_after), list(once)
        self.no_end: np.ndarray | None = None  # (V,) bool: ids after which <end> is not allowed
        self.once: np.ndarray | None = None  # (V,) bool: ids written at most once

    def log_probs(self, logits: np.ndarray, words: np.ndarray, t: int) -> np.ndarray:
        """(R, V) logits of step t after (R, t) words -> (R, V) float32 log-probs, -inf where not allowed."""
        logp = log_softmax(logits)  # (R, V)
        V = logp.shape[1]
        logp[:, self.banned] = NEG_INF
        if t < self.min_length:
            logp[:, self.end_id] = NEG_INF
        if self.no_repeat_ngram:
            block_repeated_ngrams(logp, words, self.no_repeat_ngram)
        if self.no_end_after and t > 0:
            if self.no_end is None:
                self.no_end = np.zeros(V, dtype=bool)
                self.no_end[self.no_end_after] = True
            logp[self.no_end[words[:, -1]], self.end_id] = NEG_INF  # beams whose last word is a function word
        if self.once_ids:
            if self.once is None:
                self.once = np.zeros(V, dtype=bool)
                self.once[self.once_ids] = True
            block_repeated_words(logp, words, self.once)
        return logp


def beam_search(step: Step, features: np.ndarray, keys: np.ndarray, initial: np.ndarray, beam_size: int,
                max_length: int, start_id: int, end_id: int, banned_ids: Sequence[int] = (),
                length_penalty: float = 1.0, no_repeat_ngram: int = 0, min_length: int = 0, n_best: int = 1,
                no_end_after: Sequence[int] = (), once: Sequence[int] = (),
                word_bias: np.ndarray | None = None) -> list[list[Hypothesis]]:
    """Beam search over a batch of B images: the best `n_best` hypotheses of each, best first.

    Args:
        step: one decoder step (see `Step`).
        features, keys, initial: the decoder's memory of each image, (B, L, D), (B, L, A), (B, S).
        word_bias: (B, V) added to every step's logits of each image's beams (`word_bias`), or None.
        the rest: as `captioner.decoding.search.beam_search`.
    """
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best {n_best}: expected 1 to beam_size ({beam_size})")
    B, L, K = features.shape[0], features.shape[1], beam_size
    image_of_row = np.repeat(np.arange(B), K)  # (B·K,)
    scores = np.full((B, K), NEG_INF, dtype=np.float32)
    scores[:, 0] = 0.0  # only beam 0 is live at the start: the K beams would be identical
    beams = _Beams(list(range(B)), np.full(B * K, start_id, dtype=np.int64), initial[image_of_row],
                   features[image_of_row], keys[image_of_row], scores, word_bias,
                   np.empty((B * K, 0), dtype=np.int64),
                   np.empty((B * K, 0, L), dtype=np.float32))
    finals: list[list[Hypothesis]] = [[] for _ in range(B)]
    rules = _Rules(banned_ids, end_id, min_length, no_repeat_ngram, no_end_after, once)
    for t in range(max_length + 1):
        n = len(beams.ids)
        logits, alpha, state = step(beams.tokens, beams.state, beams.features, beams.keys)  # (R, V), (R, L), (R, S)
        V = logits.shape[1]
        if beams.bias is not None:
            logits = (logits.reshape(n, K, V) + beams.bias[:, None]).reshape(n * K, V)
        logp = rules.log_probs(logits, beams.words, t)  # (R, V)
        cand = (beams.scores.reshape(-1, 1) + logp).reshape(n, K * V)  # (n, K·V)
        top_scores, top_idx = _top(cand, min(2 * K, K * V))  # (n, 2K): K live beams survive any K <end>s
        top_beam, top_tok = top_idx // V, top_idx % V  # (n, 2K)
        is_end = top_tok == end_id  # (n, 2K)
        if is_end.any():  # 1. <end> within an image's top K: a finished hypothesis
            _finalize(finals, beams, K, top_scores[:, :K], top_beam[:, :K], is_end[:, :K], length_penalty)
        if t == max_length:
            break
        going = [b for b, i in enumerate(beams.ids) if len(finals[i]) < K]  # 2. done images leave
        if not going:
            break
        if len(going) < n:
            rows = beams.keep(going, K)
            top_scores, top_beam, top_tok, is_end = (x[going] for x in (top_scores, top_beam, top_tok, is_end))
            alpha, state = alpha[rows], state[rows]
        _advance(beams, K, top_scores, top_beam, top_tok, is_end, alpha, state)
    return _results(finals, beams, K, n_best, length_penalty)


def _advance(beams: _Beams, K: int, top_scores: np.ndarray, top_beam: np.ndarray, top_tok: np.ndarray,
             is_end: np.ndarray, alpha: np.ndarray, state: np.ndarray) -> None:
    """3. The best K non-<end> candidates (n, 2K) go on: each row gathered from the beam it extends."""
    n = len(beams.ids)
    if is_end.any():
        keep = np.argsort(is_end, axis=1, kind="stable")[:, :K]  # (n, K) positions, rank order kept
        top_scores, top_beam, top_tok = (np.take_along_axis(x, keep, axis=1) for x in (top_scores, top_beam, top_tok))
    beams.scores = np.ascontiguousarray(top_scores[:, :K])  # (n, K)
    src = (np.arange(n)[:, None] * K + top_beam[:, :K]).reshape(-1)  # (R,) row each new beam comes from
    beams.tokens = top_tok[:, :K].reshape(-1).astype(np.int64)  # (R,)
    beams.state = state[src]  # (R, S)
    beams.words = np.concatenate([beams.words[src], beams.tokens[:, None]], axis=1)  # (R, t + 1)
    beams.history = np.concatenate([beams.history[src], alpha[src][:, None]], axis=1)  # (R, t + 1, L)


def _finalize(finals: list[list[Hypothesis]], beams: _Beams, K: int, scores: np.ndarray, beam: np.ndarray,
              is_end: np.ndarray, exponent: float) -> None:
    """Move the <end> candidates (n, K) of images that are not done into `finals`, in rank order."""
    for b, j in np.argwhere(is_end & np.isfinite(scores)):  # row-major: rank order within each image
        if len(finals[beams.ids[b]]) >= K:  # more <end>s in one step than the image still needs
            continue
        row = b * K + int(beam[b, j])
        finals[beams.ids[b]].append(_hypothesis(beams.words[row].tolist(), float(scores[b, j]), beams.history[row],
                                                True, exponent))


def _results(finals: list[list[Hypothesis]], beams: _Beams, K: int, n_best: int,
             exponent: float) -> list[list[Hypothesis]]:
    """Each image's finished hypotheses by score (the first found on ties), or its best live beams."""
    t, L = beams.words.shape[1], beams.history.shape[-1]
    words, history = beams.words.reshape(-1, K, t), beams.history.reshape(-1, K, t, L)  # per image
    row_of = {i: b for b, i in enumerate(beams.ids)}
    result = []
    for i, found in enumerate(finals):
        if found:
            result.append(sorted(found, key=lambda h: -h.score)[:n_best])
            continue
        b = row_of[i]
        order = np.argsort(-beams.scores[b], kind="stable")[:n_best]
        result.append([_hypothesis(words[b, k].tolist(), float(beams.scores[b, k]), history[b, k], False, exponent)
                       for k in order if math.isfinite(float(beams.scores[b, k]))])
    return result


def decode_n_best(step: Step, features: np.ndarray, keys: np.ndarray, initial: np.ndarray, cfg: DecodeConfig,
                  vocab: Vocabulary, n_best: int, word_log_probs: np.ndarray | None = None) -> list[list[Hypothesis]]:
    """`search.decode_n_best` over a step function: never <pad>, <start> or <unk>, at least one word,
    no <end> after a function word when `cfg.no_dangling`, no content word twice when
    `cfg.no_repeat_words`, the word detector's (B, V) `word_log_probs` weighted in by
    `cfg.detector_weight`; each image's best `n_best`, best first."""
    if cfg.detector_weight and word_log_probs is None:
        raise ValueError("decode.detector_weight needs the word detector's log-probabilities")
    bias = word_bias(cfg.detector_weight, word_log_probs, vocab) if cfg.detector_weight else None
    banned = (vocab.pad_id, vocab.start_id, vocab.unk_id)
    function_ids = vocab.function_ids() if cfg.no_dangling else []
    once = vocab.content_ids() if cfg.no_repeat_words else []
    return beam_search(step, features, keys, initial, cfg.beam_size, cfg.max_length, vocab.start_id, vocab.end_id,
                       banned, length_penalty=cfg.length_penalty, no_repeat_ngram=cfg.no_repeat_ngram, min_length=1,
                       n_best=n_best, no_end_after=function_ids, once=once, word_bias=bias)


def word_bias(weight: float, word_log_probs: np.ndarray, vocab: Vocabulary) -> np.ndarray:
    """(B, V) log p(the photo shows the word) -> (B, V) float32 `weight` times it for the content
    words, 0 for the others (as `search.word_bias`)."""
    content = np.zeros(len(vocab), dtype=np.float32)
    content[vocab.content_ids()] = 1.0
    return (weight * word_log_probs * content).astype(np.float32)


def force_text(step: Step, features: np.ndarray, keys: np.ndarray, initial: np.ndarray, ids: Sequence[int],
               vocab: Vocabulary, exponent: float) -> list[Hypothesis]:
    """The words `ids` (`decoding.text.text_ids`) forced on each of B images, as `forced.force_text`:
    B finished hypotheses, logprob the words' and <end>'s, score length-penalised as the search's,
    alphas (T, L) the maps the words were predicted with, word_logprobs (T,)."""
    B, T = len(features), len(ids)
    tokens = [vocab.start_id, *ids, vocab.end_id]  # (T + 2,)
    state, logprobs, alphas = initial, [], []
    for t in range(T + 1):
        logits, alpha, state = step(np.full(B, tokens[t], dtype=np.int64), state, features, keys)  # (B, V), (B, L)
        logprobs.append(log_softmax(logits)[:, tokens[t + 1]])  # (B,)
        alphas.append(alpha)
    by_image = np.stack(logprobs, axis=1).tolist()  # (B, T + 1)
    maps = np.stack(alphas, axis=1)  # (B, T + 1, L)
    return [Hypothesis(list(ids), sum(lp), sum(lp) / length_penalty(T + 1, exponent), maps[b, :T], True, lp[:T])
            for b, lp in enumerate(by_image)]
