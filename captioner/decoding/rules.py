"""What a search may write next, as -inf in its log-probabilities: never a banned id (`ban`, which
sampling and SCST share), no repeated n-gram (`block_repeated_ngrams`), a content word at most once
(`block_repeated_words`), no <end> too early nor right after a function word (`Rules`, all of them
for one beam search). `numpy_search` has the same rules in numpy.

Shapes: R rows (beams), t words so far, V vocabulary.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

NEG_INF = float("-inf")


def ban(scores: Tensor, banned: Tensor, end_id: int, too_short: Tensor | bool) -> Tensor:
    """What decoding and sampling never write, set to -inf in (R, V) `scores`, in place: the `banned`
    ids (int64 (N,)) in every row, <end> in the rows with fewer than `min_length` words (`too_short`:
    a bool for all rows, or (R,) bool). SCST masks its packed logits with it too."""
    scores.index_fill_(1, banned, NEG_INF)
    if isinstance(too_short, Tensor):
        scores[:, end_id].masked_fill_(too_short, NEG_INF)
    elif too_short:
        scores[:, end_id] = NEG_INF
    return scores


def block_repeated_ngrams(logp: Tensor, words: Tensor, n: int) -> Tensor:
    """Set to -inf, in place, every token that would repeat an n-gram already in a row's words.

    Args:
        logp: (R, V) log-probs of the next token.
        words: (R, t) the words generated so far in each row.
        n: n-gram size (>= 1); with n = 1 no word is ever repeated.
    Returns:
        logp, modified in place.
    """
    t = words.size(1)
    if n <= 0 or t < n:  # no complete n-gram yet
        return logp
    windows = words.unfold(1, n, 1)  # (R, W, n) every n-gram so far, W = t - n + 1
    if n == 1:
        match = torch.ones(windows.shape[:2], dtype=torch.bool, device=words.device)  # (R, W)
    else:
        prefix = words[:, t - n + 1 :]  # (R, n - 1) the last n-1 words
        match = (windows[:, :, :-1] == prefix.unsqueeze(1)).all(dim=-1)  # (R, W)
    penalty = torch.zeros(match.shape, dtype=logp.dtype, device=logp.device).masked_fill(match, NEG_INF)  # (R, W)
    # -inf + 0 and -inf + -inf are both -inf, so duplicates and unmatched windows are harmless.
    return logp.scatter_add_(1, windows[:, :, -1], penalty)


def block_repeated_words(logp: Tensor, words: Tensor, once: Tensor) -> Tensor:
    """Set to -inf, in place, every word a row has written already that may appear only once.

    Args:
        logp: (R, V) log-probs of the next token.
        words: (R, t) the words generated so far in each row.
        once: (V,) bool, the ids written at most once per caption (content words: no "a hat and a hat").
    Returns:
        logp, modified in place.
    """
    if words.size(1):
        penalty = torch.zeros(words.shape, dtype=logp.dtype, device=logp.device).masked_fill(once[words], NEG_INF)
        logp.scatter_add_(1, words, penalty)  # (R, t): -inf where a once-only word was written, 0 elsewhere
    return logp


class Rules:
    """What a search may write next: never a banned id; <end> not before `min_length` words nor right
    after a function word (`no_end_after`); no repeated `no_repeat_ngram`-gram; the `once` ids at
    most once per caption."""

    def __init__(self, banned_ids: Sequence[int], end_id: int, min_length: int, no_repeat_ngram: int,
                 no_end_after: Sequence[int], once: Sequence[int], device: torch.device) -> None:
        self.banned = torch.tensor(list(banned_ids), dtype=torch.long, device=device)
        self.end_id, self.min_length = end_id, min_length
        self.no_repeat_ngram, self.no_end_after, self.once_ids = no_repeat_ngram, list(no_end_after), list(once)
        self.no_end: Tensor | None = None  # (V,) bool: ids after which <end> is not allowed
        self.once: Tensor | None = None  # (V,) bool: ids written at most once

    def log_probs(self, logits: Tensor, words: Tensor, t: int) -> Tensor:
        """(R, V) logits of step t after (R, t) words -> (R, V) float32 log-probs, -inf where not allowed."""
        logp = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
        ban(logp, self.banned, self.end_id, t < self.min_length)
        if self.no_repeat_ngram:
            block_repeated_ngrams(logp, words, self.no_repeat_ngram)
        if self.no_end_after and t > 0:
            if self.no_end is None:
                self.no_end = torch.zeros(logp.size(-1), dtype=torch.bool, device=logp.device)
                self.no_end[self.no_end_after] = True
            logp[:, self.end_id].masked_fill_(self.no_end[words[:, -1]], NEG_INF)  # last word a function word
        if self.once_ids:
            if self.once is None:
                self.once = torch.zeros(logp.size(-1), dtype=torch.bool, device=logp.device)
                self.once[self.once_ids] = True
            block_repeated_words(logp, words, self.once)
        return logp
