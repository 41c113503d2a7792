"""Decoding an `AttentionDecoder`: batched beam search, each word with its attention map.

Shapes: B batch (images), n images still searched, K beams, R = n·K rows, L = H'·W' regions,
D feature width, H hidden width, V vocabulary, t words generated so far.

Beam search follows fairseq's `search.py` / HF `generate`: the memory (features and attention
keys) is built once per image and read by its K rows (`Memory.expand`: shared, not copied); each
step is one `topk` over the (B, K·V) candidate scores, beam = idx // V and token = idx % V; only
beam 0 is live at the start. The hidden state, the words and the attention history are gathered
by source beam every step, so a hypothesis carries the attention of the step that produced each of
its words.

An `<end>` candidate among an image's top K is set aside as a finished hypothesis (its score is
length-penalised); the other top candidates continue. An image is done when it holds K finished
hypotheses (fairseq's rule, which makes K = 1 exactly greedy decoding), or after `max_length` words
plus one more step for `<end>`. A done image's rows leave the batch, so a batch costs what its
images cost one by one, not its longest caption times its size. When no beam of an image ever
ended, its best live beam is returned with `finished=False`: there is always a caption.
`min_length` (1 in `decode`) keeps <end> away until a caption has words. The steps are small
named functions, as fairseq's `SequenceGenerator` has them: `_expand`, `_top_candidates`,
`_finalize`, `_prune`, `_advance`, `_best`.

Log-probabilities come from a float32 log-softmax over the full vocabulary; banned ids
(`<pad>`, `<start>`, `<unk>` in `decode`) are set to -inf *after* it (`rules.ban`, which sampling uses
too), so a score is the model's own probability of the words it wrote; with `decode.detector_weight`
w, the logits first gain w · log p(the photo shows the word) for every content word (`word_bias`:
shallow fusion with the decoder's word detector, a product of the two models renormalised), so a
content word the detector does not see in the photo costs more. Callers put the decoder in
eval mode (dropout off) and run under `torch.inference_mode()`; these functions also disable
autograd themselves. Nothing here picks a device: every tensor follows `features`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from captioner.config import DecodeConfig
from captioner.data.vocab import Vocabulary
from captioner.decoding.rules import NEG_INF, Rules
from captioner.model.decoder import AttentionDecoder
from captioner.model.memory import Memory


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


class _Beams(NamedTuple):
    """The live beams of the n images still searched: R = n·K rows, image by image."""

    ids: list[int]  # the input index of each image
    tokens: Tensor  # (R,) the last word of each beam
    hidden: Tensor  # (R, H)
    memory: Memory  # each image's, read by its K rows (`Memory.expand`)
    scores: Tensor  # (n, K) summed log-probs; -inf for a beam not live
    bias: Tensor | None  # (n, V) added to each image's logits (`word_bias`), or None
    words: Tensor  # (R, t)
    history: Tensor  # (R, t, L) float32: the attention of the step that wrote each word


class _Top(NamedTuple):
    """The best 2K candidates of each image, (n, 2K) each, best first: K live beams survive any K <end>s."""

    scores: Tensor
    beam: Tensor  # the beam within the image a candidate extends
    token: Tensor
    is_end: Tensor
    any_end: bool  # most steps have none: nothing to sort out


@torch.no_grad()
def beam_search(decoder: AttentionDecoder, features: Tensor, beam_size: int, max_length: int, start_id: int,
                end_id: int, banned_ids: Sequence[int] = (), length_penalty: float = 1.0, no_repeat_ngram: int = 0,
                min_length: int = 0, n_best: int = 1, no_end_after: Sequence[int] = (),
                once: Sequence[int] = (), word_bias: Tensor | None = None) -> list[list[Hypothesis]]:
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
        once: ids written at most once per caption (content words: no "a man wearing a hat and a hat").
        word_bias: (B, V) added to every step's logits of each image's beams (`word_bias`), or None.
    Returns:
        B lists, in input order, each the image's finished hypotheses by score (the first found on
        ties), at most `n_best`; an image none of whose beams ended gets its best live beams instead.
    """
    if not 1 <= n_best <= beam_size:
        raise ValueError(f"n_best {n_best}: expected 1 to beam_size ({beam_size})")
    K, rules = beam_size, Rules(banned_ids, end_id, min_length, no_repeat_ngram, no_end_after, once,
                                 features.device)
    beams = _expand(decoder, features, K, start_id, word_bias)
    finals: list[list[Hypothesis]] = [[] for _ in range(features.size(0))]
    for t in range(max_length + 1):
        out = decoder.step(beams.tokens, beams.hidden, beams.memory)  # logits (R, V), alpha (R, L), hidden (R, H)
        logits = out.logits if beams.bias is None else _biased(out.logits, beams.bias, K)
        top = _top_candidates(beams.scores, rules.log_probs(logits, beams.words, t), K, end_id)
        if top.any_end:  # an <end> within an image's top K ranks: a finished hypothesis
            _finalize(finals, beams, K, top, length_penalty)
        if t == max_length:
            break
        going = [b for b, i in enumerate(beams.ids) if len(finals[i]) < K]  # K finished: the image is done
        if not going:
            break
        hidden, alpha = out.hidden, out.alpha  # (R, H), (R, L)
        if len(going) < len(beams.ids):
            beams, top, hidden, alpha = _prune(beams, top, hidden, alpha, going, K)
        beams = _advance(beams, top, hidden, alpha, K)
    return [_best(finals[i], beams, i, n_best, length_penalty) for i in range(features.size(0))]


def _biased(logits: Tensor, bias: Tensor, K: int) -> Tensor:
    """(n·K, V) logits + each image's (n, V) bias on its K rows."""
    n, V = bias.shape
    return (logits.float().view(n, K, V) + bias.unsqueeze(1)).view(n * K, V)


def _expand(decoder: AttentionDecoder, features: Tensor, K: int, start_id: int, bias: Tensor | None) -> _Beams:
    """The memory once per image, expanded to B·K rows; only beam 0 live (the K would be identical)."""
    B, L, _ = features.shape
    device = features.device
    memory = decoder.memory(features)  # once per image: features (B, L, D), keys (B, L, A)
    hidden = decoder.init_hidden(memory).repeat_interleave(K, dim=0)  # (B, H) -> (B·K, H): 0,0,..,1,1,..
    scores = torch.full((B, K), NEG_INF, dtype=torch.float32, device=device)  # (B, K)
    scores[:, 0] = 0.0
    return _Beams(list(range(B)), torch.full((B * K,), start_id, dtype=torch.long, device=device), hidden,
                  memory.expand(K), scores, bias, torch.empty(B * K, 0, dtype=torch.long, device=device),
                  torch.empty(B * K, 0, L, dtype=torch.float32, device=device))


def _top_candidates(scores: Tensor, logp: Tensor, K: int, end_id: int) -> _Top:
    """One `topk` over each image's (K·V) candidate scores: beam = idx // V, token = idx % V."""
    n, V = scores.size(0), logp.size(-1)
    cand = (scores.view(n * K, 1) + logp).view(n, K * V)  # (n, K·V)
    top_scores, top_idx = cand.topk(min(2 * K, K * V), dim=1)  # (n, 2K)
    token = top_idx % V  # (n, 2K)
    is_end = token == end_id  # (n, 2K)
    return _Top(top_scores, torch.div(top_idx, V, rounding_mode="floor"), token, is_end, bool(is_end.any()))


def _prune(beams: _Beams, top: _Top, hidden: Tensor, alpha: Tensor, going: list[int],
           K: int) -> tuple[_Beams, _Top, Tensor, Tensor]:
    """Only the rows of the images still `going` (their indices among the n): done images leave the batch."""
    sel = torch.tensor(going, device=hidden.device)  # (n',)
    rows = (sel.unsqueeze(1) * K + torch.arange(K, device=hidden.device)).view(-1)  # (n'·K,)
    bias = None if beams.bias is None else beams.bias.index_select(0, sel)
    kept = beams._replace(ids=[beams.ids[b] for b in going], memory=beams.memory.select_images(sel, K), bias=bias,
                          words=beams.words.index_select(0, rows), history=beams.history.index_select(0, rows))
    top = _Top(*(x.index_select(0, sel) for x in top[:4]), top.any_end)
    return kept, top, hidden.index_select(0, rows), alpha.index_select(0, rows)


def _advance(beams: _Beams, top: _Top, hidden: Tensor, alpha: Tensor, K: int) -> _Beams:
    """The best K candidates that are not <end> become the beams (a stable sort keeps the rank order;
    each beam has one <end>, so 2K candidates hold at least K others); hidden state, words and
    attention history are gathered by the beam each comes from."""
    scores, beam, token = top.scores, top.beam, top.token  # (n, 2K)
    if top.any_end:
        keep = torch.sort(top.is_end.to(torch.uint8), dim=1, stable=True).indices[:, :K]  # (n, K) positions
        scores, beam, token = (x.gather(1, keep) for x in (scores, beam, token))  # (n, K)
    n = len(beams.ids)
    src = (torch.arange(n, device=beam.device).unsqueeze(1) * K + beam[:, :K]).reshape(n * K)  # (R,) each one's row
    tokens = token[:, :K].reshape(n * K)  # (R,)
    return beams._replace(
        tokens=tokens, hidden=hidden.index_select(0, src), scores=scores[:, :K].contiguous(),
        words=torch.cat([beams.words.index_select(0, src), tokens.unsqueeze(1)], dim=1),  # (R, t + 1)
        history=torch.cat([beams.history.index_select(0, src), alpha.index_select(0, src).unsqueeze(1)], dim=1))


def _finalize(finals: list[list[Hypothesis]], beams: _Beams, K: int, top: _Top, exponent: float) -> None:
    """Move the <end> candidates among the top K of images that are not done into `finals`, in rank
    order, each with the words and attention of the beam it ends (before this step)."""
    scores, ends = top.scores[:, :K], top.is_end[:, :K] & torch.isfinite(top.scores[:, :K])  # (n, K)
    if not bool(ends.any()):
        return
    scores_, beams_ = scores.tolist(), top.beam[:, :K].tolist()  # one transfer, not one per candidate
    for b, j in ends.nonzero().tolist():  # row-major: rank order within each image
        if len(finals[beams.ids[b]]) >= K:  # more <end>s in one step than the image still needs
            continue
        row = b * K + beams_[b][j]
        finals[beams.ids[b]].append(_hypothesis(beams.words[row].tolist(), scores_[b][j], beams.history[row], True,
                                                exponent))


def _best(finals: list[Hypothesis], beams: _Beams, image: int, n_best: int, exponent: float) -> list[Hypothesis]:
    """An image's finished hypotheses by score (a stable sort keeps the first found on ties); an
    image without one is still among the beams (only done images leave), and its best live beams
    are returned unfinished."""
    if finals:
        return sorted(finals, key=lambda h: -h.score)[:n_best]
    K = beams.scores.size(1)
    b = beams.ids.index(image)
    rows = range(b * K, b * K + K)
    order = beams.scores[b].argsort(descending=True, stable=True)[:n_best].tolist()
    return [_hypothesis(beams.words[rows[k]].tolist(), float(beams.scores[b, k]), beams.history[rows[k]], False,
                        exponent) for k in order if math.isfinite(float(beams.scores[b, k]))]


def decode(decoder: AttentionDecoder, features: Tensor, cfg: DecodeConfig, vocab: Vocabulary) -> list[Hypothesis]:
    """Caption a batch of (B, L, D) grids as `cfg` says (beam_size 1 = greedy). Never emits <pad>,
    <start> or <unk>, and every caption has at least one word; no <end> after a function word when
    `cfg.no_dangling`, no content word twice when `cfg.no_repeat_words`. Returns B hypotheses in
    input order."""
    return [ranked[0] for ranked in decode_n_best(decoder, features, cfg, vocab, 1)]


def decode_n_best(decoder: AttentionDecoder, features: Tensor, cfg: DecodeConfig, vocab: Vocabulary,
                  n_best: int) -> list[list[Hypothesis]]:
    """`decode`, keeping each image's best `n_best` (<= cfg.beam_size) hypotheses, best first."""
    banned = (vocab.pad_id, vocab.start_id, vocab.unk_id)
    bias = word_bias(cfg.detector_weight, decoder.word_log_probs(features), vocab) if cfg.detector_weight else None
    function_ids = vocab.function_ids() if cfg.no_dangling else []
    once = vocab.content_ids() if cfg.no_repeat_words else []
    return beam_search(decoder, features, cfg.beam_size, cfg.max_length, vocab.start_id, vocab.end_id, banned,
                       length_penalty=cfg.length_penalty, no_repeat_ngram=cfg.no_repeat_ngram, min_length=1,
                       n_best=n_best, no_end_after=function_ids, once=once, word_bias=bias)


def word_bias(weight: float, word_log_probs: Tensor, vocab: Vocabulary) -> Tensor:
    """(B, V) log p(the photo shows the word) from the word detector -> (B, V) float32 `weight` times it
    for the content words (`Vocabulary.content_ids`), 0 for the function words and the specials."""
    content = torch.zeros(len(vocab), device=word_log_probs.device)
    content[vocab.content_ids()] = 1.0
    return weight * word_log_probs.float() * content  # (B, V)
