"""Decoding an `AttentionDecoder`: batched beam search, each word with its attention map.

Shapes: B batch (images), n images still searched, K beams, R = n·K rows, L = H'·W' regions,
D feature width, H hidden width, V vocabulary, t words generated so far.

Beam search follows fairseq's `search.py` / HF `generate`: the memory (features and attention
keys) is built once per image and expanded to B·K rows; each step is one `topk` over the (B, K·V)
candidate scores, beam = idx // V and token = idx % V; only beam 0 is live at the start. The
hidden state, the words and the attention history are gathered by source beam every step, so a
hypothesis carries the attention of the step that produced each of its words.

An `<end>` candidate among an image's top K is set aside as a finished hypothesis (its score is
length-penalised); the other top candidates continue. An image is done when it holds K finished
hypotheses (fairseq's rule, which makes K = 1 exactly greedy decoding), or after `max_length` words
plus one more step for `<end>`. A done image's rows leave the batch, so a batch costs what its
images cost one by one, not its longest caption times its size. When no
beam of an image ever ended, its best live beam is returned with `finished=False`: there is
always a caption. `min_length` (1 in `decode`) keeps <end> away until a caption has words.

Log-probabilities come from a float32 log-softmax over the full vocabulary; banned ids
(`<pad>`, `<start>`, `<unk>` in `decode`) are set to -inf *after* it, so a score is the model's
own probability of the words it wrote. Callers put the decoder in eval mode (dropout off) and run
under `torch.inference_mode()`; these functions also disable autograd themselves. Nothing here
picks a device: every tensor follows `features`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from captioner.config import DecodeConfig
from captioner.data.vocab import FUNCTION_WORDS, Vocabulary
from captioner.model.decoder import AttentionDecoder

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Hypothesis:
    """One decoded caption.

    tokens: word ids, without <start>/<end>.
    logprob: sum of the log-probabilities of the tokens, plus <end>'s when finished.
    score: logprob / length_penalty(len(tokens) + finished, exponent), what the search ranks by.
    alphas: (len(tokens), L) the attention of the step that produced each word.
    finished: True when the caption ended with <end>; False when cut at max_length.
    word_logprobs: each word's log-probability, when known (a teacher-forced caption's; a search keeps
        only the sums).
    """

    tokens: list[int]
    logprob: float
    score: float
    alphas: Tensor
    finished: bool
    word_logprobs: list[float] | None = None


def length_penalty(length: int, exponent: float) -> float:
    """`length ** exponent` (the divisor of a summed log-prob); 0 = no normalisation, 1 = per-token mean.

    `length` counts the generated tokens, <end> included when reached; it is at least 1.
    """
    return float(max(length, 1)) ** exponent


def _hypothesis(tokens: list[int], logprob: float, alphas: Tensor, finished: bool, exponent: float) -> Hypothesis:
    score = logprob / length_penalty(len(tokens) + int(finished), exponent)
    return Hypothesis(tokens, logprob, score, alphas, finished)


def _log_probs(logits: Tensor, banned: Tensor) -> Tensor:
    """(R, V) logits -> (R, V) float32 log-probs with the `banned` ids (int64 (N,)) at -inf."""
    return torch.log_softmax(logits.float(), dim=-1).index_fill_(1, banned, NEG_INF)  # (R, V)


def _banned(banned_ids: Sequence[int], end_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The ids never emitted, and those plus <end> (before min_length), as int64 tensors."""
    return (torch.tensor(list(banned_ids), dtype=torch.long, device=device),
            torch.tensor([*banned_ids, end_id], dtype=torch.long, device=device))


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


@torch.no_grad()
def beam_search(
    decoder: AttentionDecoder,
    features: Tensor,
    beam_size: int,
    max_length: int,
    start_id: int,
    end_id: int,
    banned_ids: Sequence[int] = (),
    length_penalty: float = 1.0,
    no_repeat_ngram: int = 0,
    min_length: int = 0,
    n_best: int = 1,
    no_end_after: Sequence[int] = (),
) -> list[list[Hypothesis]]:
    """Beam search over a batch of images; the best `n_best` hypotheses per image, best first.

    Args:
        decoder: in eval mode.
        features: (B, L, D) encoder grids.
        beam_size: K, beams per image.
        max_length: most words per caption (without <start>/<end>); one more step may emit <end>.
        start_id, end_id: the <start> and <end> ids.
        banned_ids: ids never emitted.
        length_penalty: the exponent; finished hypotheses are ranked by logprob / length**length_penalty.
        no_repeat_ngram: block repeated n-grams of this size (0 = off).
        min_length: <end> is not allowed before this many words.
        n_best: hypotheses returned per image (at most beam_size).
        no_end_after: ids after which <end> is not allowed (function words: no "a man riding a").
    Returns:
        B lists, in input order, each the image's finished hypotheses by score (the first found on
        ties), at most `n_best`; an image none of whose beams ended gets its best live beams instead.
    """
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best {n_best}: expected 1 to beam_size ({beam_size})")
    B, L, _ = features.shape
    K = beam_size
    device = features.device
    memory = decoder.memory(features)  # once per image: features (B, L, D), keys (B, L, A)
    image_of_row = torch.arange(B, device=device).repeat_interleave(K)  # (B·K,): 0,0,..,1,1,..
    hidden = decoder.init_hidden(memory)[image_of_row]  # (B, H) -> (B·K, H)
    memory = memory.select(image_of_row)  # (B·K, L, D), (B·K, L, A)
    tokens = torch.full((B * K,), start_id, dtype=torch.long, device=device)  # (R,)
    scores = torch.full((B, K), NEG_INF, dtype=torch.float32, device=device)  # (B, K) summed log-probs
    scores[:, 0] = 0.0  # only beam 0 is live at the start: the K beams would be identical
    words = torch.empty(B * K, 0, dtype=torch.long, device=device)  # (R, t)
    history = torch.empty(B * K, 0, L, dtype=torch.float32, device=device)  # (R, t, L) float32 maps
    ids = list(range(B))  # the input index of each image still searched; R = len(ids)·K rows
    finals: list[list[Hypothesis]] = [[] for _ in range(B)]
    banned, banned_with_end = _banned(banned_ids, end_id, device)
    no_end = None  # (V,) bool: ids after which <end> is not allowed
    first_rows = torch.arange(B, device=device).unsqueeze(1) * K  # (B, 1) first row of each image
    for t in range(max_length + 1):
        n, R = len(ids), len(ids) * K
        out = decoder.step(tokens, hidden, memory)  # logits (R, V), alpha (R, L), hidden (R, H)
        V = out.logits.size(-1)
        logp = _log_probs(out.logits, banned_with_end if t < min_length else banned)  # (R, V)
        if no_repeat_ngram:
            block_repeated_ngrams(logp, words, no_repeat_ngram)
        if no_end_after and t > 0:
            if no_end is None:
                no_end = torch.zeros(V, dtype=torch.bool, device=device)
                no_end[list(no_end_after)] = True
            logp[:, end_id].masked_fill_(no_end[words[:, -1]], NEG_INF)  # beams whose last word is a function word
        cand = (scores.view(R, 1) + logp).view(n, K * V)  # (n, K·V)
        top_scores, top_idx = cand.topk(min(2 * K, K * V), dim=1)  # (n, 2K): K live beams survive any K <end>s
        top_beam = torch.div(top_idx, V, rounding_mode="floor")  # (n, 2K) beam within the image
        top_tok = top_idx % V  # (n, 2K)
        is_end = top_tok == end_id  # (n, 2K)
        new_hidden, new_alpha = out.hidden, out.alpha  # (R, H), (R, L)

        any_end = bool(is_end.any())  # most steps have none among the 2K candidates: nothing to sort out

        # 1. <end> within an image's top K ranks: a finished hypothesis (words so far, no new word).
        if any_end:
            _finalize(finals, ids, K, top_scores[:, :K], top_beam[:, :K], is_end[:, :K], words, history,
                      length_penalty)
        if t == max_length:
            break

        # 2. An image with K finished hypotheses is done: its rows leave the batch.
        going = [b for b, i in enumerate(ids) if len(finals[i]) < K]
        if not going:
            break
        if len(going) < n:
            sel = torch.tensor(going, device=device)  # (n',)
            rows = (sel.unsqueeze(1) * K + torch.arange(K, device=device)).view(-1)  # (n'·K,)
            ids = [ids[b] for b in going]
            top_scores, top_beam, top_tok, is_end = (x.index_select(0, sel) for x in (top_scores, top_beam, top_tok, is_end))
            new_hidden, new_alpha = new_hidden.index_select(0, rows), new_alpha.index_select(0, rows)
            words, history = words.index_select(0, rows), history.index_select(0, rows)
            memory = memory.select(rows)
            n, R = len(ids), len(ids) * K

        # 3. The best K non-<end> candidates continue (a stable sort keeps the rank order). Each beam
        # has one <end>, so 2K candidates hold at least K others.
        if any_end:
            keep = torch.sort(is_end.to(torch.uint8), dim=1, stable=True).indices[:, :K]  # (n, K) positions
            top_scores, top_beam, top_tok = (x.gather(1, keep) for x in (top_scores, top_beam, top_tok))  # (n, K)
        scores = top_scores[:, :K].contiguous()  # (n, K)
        src = (first_rows[:n] + top_beam[:, :K]).reshape(R)  # (R,) row each new beam comes from
        tokens = top_tok[:, :K].reshape(R)  # (R,)
        hidden = new_hidden.index_select(0, src)  # (R, H)
        words = torch.cat([words.index_select(0, src), tokens.unsqueeze(1)], dim=1)  # (R, t + 1)
        history = torch.cat([history.index_select(0, src), new_alpha.index_select(0, src).unsqueeze(1)], dim=1)  # (R, t + 1, L)

    # The finished hypotheses by score (a stable sort keeps the first found on ties); an image without
    # one is still in `ids` (only done images leave), and its best live beams are returned unfinished.
    t = words.size(1)
    words, history = words.view(len(ids), K, t), history.view(len(ids), K, t, L)  # per image
    row_of = {i: b for b, i in enumerate(ids)}
    result = []
    for i in range(B):
        if finals[i]:
            result.append(sorted(finals[i], key=lambda h: -h.score)[:n_best])
        else:
            b = row_of[i]
            order = scores[b].argsort(descending=True, stable=True)[:n_best].tolist()
            result.append([_hypothesis(words[b, k].tolist(), float(scores[b, k]), history[b, k], False,
                                       length_penalty) for k in order if math.isfinite(float(scores[b, k]))])
    return result


def _finalize(
    finals: list[list[Hypothesis]],
    ids: list[int],
    K: int,
    scores: Tensor,
    beams: Tensor,
    is_end: Tensor,
    words: Tensor,
    history: Tensor,
    exponent: float,
) -> None:
    """Move the <end> candidates of images that are not done into `finals`, in rank order.

    ids: input index of each of the n images; scores, beams, is_end: (n, K) the top K candidates;
    words (n·K, t), history (n·K, t, L) before this step.
    """
    ends = is_end & torch.isfinite(scores)  # (n, K)
    if not bool(ends.any()):
        return
    scores_, beams_ = scores.tolist(), beams.tolist()  # one transfer, not one per candidate
    for b, j in ends.nonzero().tolist():  # row-major: rank order within each image
        if len(finals[ids[b]]) >= K:  # more <end>s in one step than the image still needs
            continue
        row = b * K + beams_[b][j]
        finals[ids[b]].append(_hypothesis(words[row].tolist(), scores_[b][j], history[row], True, exponent))


def decode(decoder: AttentionDecoder, features: Tensor, cfg: DecodeConfig, vocab: Vocabulary) -> list[Hypothesis]:
    """Caption a batch of (B, L, D) grids as `cfg` says (beam_size 1 = greedy). Never emits <pad>,
    <start> or <unk>, and every caption has at least one word. Returns B hypotheses in input order."""
    return [ranked[0] for ranked in decode_n_best(decoder, features, cfg, vocab, 1)]


def decode_n_best(decoder: AttentionDecoder, features: Tensor, cfg: DecodeConfig, vocab: Vocabulary,
                  n_best: int) -> list[list[Hypothesis]]:
    """`decode`, keeping each image's best `n_best` (<= cfg.beam_size) hypotheses, best first."""
    banned = (vocab.pad_id, vocab.start_id, vocab.unk_id)
    function_ids = [vocab.id(w) for w in sorted(FUNCTION_WORDS) if w in vocab] if cfg.no_dangling else []
    return beam_search(decoder, features, cfg.beam_size, cfg.max_length, vocab.start_id, vocab.end_id, banned,
                       length_penalty=cfg.length_penalty, no_repeat_ngram=cfg.no_repeat_ngram, min_length=1,
                       n_best=n_best, no_end_after=function_ids)


@torch.no_grad()
def sample(decoder: AttentionDecoder, features: Tensor, n: int, max_length: int, start_id: int, end_id: int,
           pad_id: int, banned_ids: Sequence[int] = (), min_length: int = 1,
           generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """`n` captions per image drawn from the model (multinomial, temperature 1), with the masking
    and length limits decoding uses: banned ids never drawn, no <end> before `min_length` words,
    at most `max_length` words (a caption cut there has no <end>).

    Args:
        decoder: in the mode whose distribution is wanted (eval: no dropout).
        features: (B, L, D) encoder grids.
        n: captions per image; rows b·n .. b·n + n - 1 are image b's.
    Returns:
        tokens (B·n, T) word ids, then <end> where drawn, then <pad>; lengths (B·n,) the scored
        positions of each (its words, plus <end> when drawn), at least 1.
    """
    B = features.size(0)
    R = B * n
    memory = decoder.memory(features)  # (B, L, D), (B, L, A): once per image
    rows = torch.arange(B, device=features.device).repeat_interleave(n)  # (R,)
    state = decoder.init_hidden(memory)[rows]  # (R, H) or (R, H + D)
    memory = memory.select(rows)  # (R, L, D), (R, L, A)
    token = torch.full((R,), start_id, dtype=torch.long, device=features.device)  # (R,)
    alive = torch.ones(R, dtype=torch.bool, device=features.device)  # (R,) not ended yet
    banned, banned_with_end = _banned(banned_ids, end_id, features.device)
    drawn = []
    for t in range(max_length):  # a caption still going after max_length words is cut (no <end>)
        out = decoder.step(token, state, memory)  # logits (R, V), hidden (R, ...)
        logp = _log_probs(out.logits, banned_with_end if t < min_length else banned)  # (R, V)
        token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)  # (R,)
        token = torch.where(alive, token, torch.full_like(token, pad_id))
        drawn.append(token)
        alive &= token != end_id
        state = out.hidden
        if not bool(alive.any()):
            break
    tokens = torch.stack(drawn, dim=1)  # (R, T)
    return tokens, (tokens != pad_id).sum(dim=1)
