import copy
import dataclasses
import itertools

import pytest
import torch

from captioner.config import DecodeConfig, DecoderConfig
from captioner.data.vocab import Vocabulary
from captioner.decoding.rules import block_repeated_ngrams, block_repeated_words
from captioner.decoding.search import beam_search, decode, decode_n_best, length_penalty
from captioner.model.decoder import AttentionDecoder

B, L, D, V = 4, 9, 16, 30
PAD, START, END, UNK = 0, 1, 2, 3
BANNED = (PAD, START, UNK)
CFG = DecoderConfig(embed_dim=8, hidden_dim=12, attention_dim=10, dropout=0.0, feature_dim=0)


def _decoder(vocab_size: int = V, sharpen: float = 4.0, end_bias: float = 1.0, attend: str = "before") -> AttentionDecoder:
    """A random decoder whose word distributions are peaked enough to avoid near-ties, and whose
    <end> is likely enough that captions end after 0 to 10 words (or not at all): images of a
    batch finish at different steps."""
    dec = AttentionDecoder(vocab_size, D, dataclasses.replace(CFG, attend=attend), grid=(3, 3)).eval()
    with torch.no_grad():
        dec.readout.weight.mul_(sharpen)
        dec.readout.bias[END] += end_bias
    return dec


def best_of(*args, **kwargs):
    """The best hypothesis per image (beam_search returns each image's ranked list)."""
    return [ranked[0] for ranked in beam_search(*args, **kwargs)]


def _teacher_forced(dec, features, tokens, finished):
    """Log-prob and attention of a caption, scored by the teacher-forced forward pass."""
    seq = torch.tensor([[START, *tokens, END]])  # (1, T + 1)
    out = dec(features.unsqueeze(0), seq, torch.tensor([seq.size(1) - 1]))  # one caption: packed = its T steps
    logp = torch.log_softmax(out.logits.float(), -1)  # (T, V)
    steps = len(tokens) + int(finished)
    return logp[torch.arange(steps), seq[0, 1 : steps + 1]].sum().item(), out.alphas[: len(tokens)]


def test_length_penalty_is_pure_power():
    assert length_penalty(5, 0.0) == 1.0
    assert length_penalty(4, 1.0) == 4.0
    assert length_penalty(9, 0.5) == pytest.approx(3.0)
    assert length_penalty(0, 1.0) == 1.0  # never divides by zero


@torch.no_grad()
def _greedy(dec, features, max_length, no_repeat_ngram=0):
    """Greedy decoding written out plainly, one image at a time: the reference beam search with K = 1
    must reproduce. Returns (tokens, summed log-prob, finished, (T, L) attention)."""
    memory = dec.memory(features.unsqueeze(0))
    hidden = dec.init_hidden(memory)
    token, words, logprob, maps = torch.tensor([START]), [], 0.0, []
    for _ in range(max_length + 1):
        out = dec.step(token, hidden, memory)
        logp = torch.log_softmax(out.logits.float(), -1)[0]  # (V,)
        logp[list(BANNED)] = float("-inf")
        if no_repeat_ngram and len(words) >= no_repeat_ngram:
            n = no_repeat_ngram
            for i in range(len(words) - n + 1):
                if words[i : i + n - 1] == words[len(words) - n + 1 :]:
                    logp[words[i + n - 1]] = float("-inf")
        if len(words) == max_length:  # cut: no room for another word
            return words, logprob, False, torch.stack(maps) if maps else torch.empty(0, L)
        best = int(logp.argmax())
        if best == END:
            return words, logprob + float(logp[END]), True, torch.stack(maps) if maps else torch.empty(0, L)
        words.append(best)
        logprob += float(logp[best])
        maps.append(out.alpha[0])
        token, hidden = torch.tensor([best]), out.hidden
    raise AssertionError("unreachable")


@pytest.mark.parametrize("exponent, ngram", [(0.0, 0), (1.0, 0), (0.7, 2)])
def test_beam_of_one_is_greedy(exponent, ngram):
    dec, features = _decoder(), torch.randn(B, L, D)
    for f, hyp in zip(features, best_of(dec, features, 1, 12, START, END, BANNED, length_penalty=exponent,
                                            no_repeat_ngram=ngram)):
        words, logprob, finished, maps = _greedy(dec, f, 12, ngram)
        assert hyp.tokens == words and hyp.finished == finished
        assert hyp.logprob == pytest.approx(logprob, abs=1e-4)
        assert hyp.score == pytest.approx(logprob / length_penalty(len(words) + finished, exponent), abs=1e-4)
        torch.testing.assert_close(hyp.alphas, maps)


@pytest.mark.parametrize("exponent, ngram", [(1.0, 0), (0.0, 2)])
def test_batched_beam_equals_one_image_at_a_time(exponent, ngram):
    dec, features = _decoder(), torch.randn(8, L, D)
    batched = best_of(dec, features, 3, 10, START, END, BANNED, length_penalty=exponent, no_repeat_ngram=ngram)
    for i, hyp in enumerate(batched):
        (alone,) = best_of(dec, features[i : i + 1], 3, 10, START, END, BANNED, length_penalty=exponent,
                               no_repeat_ngram=ngram)
        assert hyp.tokens == alone.tokens and hyp.finished == alone.finished
        assert hyp.score == pytest.approx(alone.score, abs=1e-5)
        assert hyp.logprob == pytest.approx(alone.logprob, abs=1e-5)
        torch.testing.assert_close(hyp.alphas, alone.alphas)
    lengths = {(len(h.tokens), h.finished) for h in batched}
    assert len(lengths) > 2 and (10, False) in lengths  # images leave the batch at different steps


@pytest.mark.parametrize("attend", ["before", "after"])
def test_scores_and_attention_match_the_teacher_forced_pass(attend):
    """Each hypothesis carries its own attention history: gathering by the wrong beam would break this."""
    dec, features = _decoder(attend=attend), torch.randn(B, L, D)
    for hyp, f in zip(best_of(dec, features, 4, 10, START, END, BANNED, length_penalty=0.5), features):
        assert hyp.alphas.shape == (len(hyp.tokens), L)
        torch.testing.assert_close(hyp.alphas.sum(-1), torch.ones(len(hyp.tokens)))
        logprob, alphas = _teacher_forced(dec, f, hyp.tokens, hyp.finished)
        assert hyp.logprob == pytest.approx(logprob, abs=1e-4)
        assert hyp.score == pytest.approx(hyp.logprob / length_penalty(len(hyp.tokens) + hyp.finished, 0.5))
        torch.testing.assert_close(hyp.alphas, alphas)


def test_wide_beam_finds_the_exhaustive_best():
    """V = 4 specials + 2 words and max_length 2: a 16-wide beam sees every caption."""
    dec, features = _decoder(vocab_size=6, sharpen=1.0), torch.randn(3, L, D)
    for hyp, f in zip(best_of(dec, features, 16, 2, START, END, BANNED, length_penalty=1.0), features):
        best = max(
            (_teacher_forced(dec, f, list(c), True)[0] / length_penalty(len(c) + 1, 1.0), list(c))
            for n in range(3) for c in itertools.product((4, 5), repeat=n)
        )
        assert hyp.finished and hyp.tokens == best[1] and hyp.score == pytest.approx(best[0], abs=1e-5)


@pytest.mark.parametrize("beam", [1, 3])
def test_a_caption_that_never_ends_is_returned_unfinished(beam):
    dec, features = _decoder(), torch.randn(B, L, D)
    with torch.no_grad():
        dec.readout.bias[END] = -1e4  # <end> is never likely
    hyps = best_of(dec, features, beam, 5, START, END, BANNED)
    for hyp, f in zip(hyps, features):
        assert not hyp.finished and len(hyp.tokens) == 5 and hyp.alphas.shape == (5, L)
        assert hyp.logprob == pytest.approx(_teacher_forced(dec, f, hyp.tokens, False)[0], abs=1e-4)


VOCAB = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", *(f"w{i}" for i in range(V - 4))])


@pytest.mark.parametrize("beam", [1, 4])
def test_specials_are_never_emitted(beam):
    dec, features = _decoder(), torch.randn(B, L, D)
    with torch.no_grad():
        dec.readout.bias[[PAD, START, UNK]] = 50.0  # the model wants nothing but specials
    for hyp in decode(dec, features, DecodeConfig(beam_size=beam, max_length=8), VOCAB):
        assert not set(hyp.tokens) & {PAD, START, UNK, END}
        assert all(4 <= t < V for t in hyp.tokens)


@pytest.mark.parametrize("beam", [1, 3])
def test_a_model_that_wants_to_stop_at_once_still_writes_its_best_word(beam):
    """<end> first is by far the most likely caption; `decode` holds it back for one word (min_length
    1), and that word is the one the model ranks highest after <end>, followed by <end>."""
    dec, features = _decoder(), torch.randn(B, L, D)
    with torch.no_grad():
        dec.readout.bias[END] = 40.0
    first = dec.step(torch.full((B,), START), dec.init_hidden(dec.memory(features)), dec.memory(features)).logits
    first[:, [PAD, START, END, UNK]] = float("-inf")
    for hyp, best in zip(decode(dec, features, DecodeConfig(beam_size=beam, max_length=8), VOCAB),
                         first.argmax(-1).tolist()):
        assert hyp.tokens == [best] and hyp.finished


def test_block_repeated_ngrams_on_a_hand_made_history():
    words = torch.tensor([[5, 6, 5, 6, 5], [7, 8, 9, 7, 8]])  # (R, t)
    blocked = block_repeated_ngrams(torch.zeros(2, 12), words, 2)
    assert torch.isinf(blocked[0]).nonzero().flatten().tolist() == [6]  # "5 6" seen; the last word is 5
    assert torch.isinf(blocked[1]).nonzero().flatten().tolist() == [9]  # "8 9" seen; the last word is 8
    blocked = block_repeated_ngrams(torch.zeros(2, 12), words, 3)
    assert torch.isinf(blocked[0]).nonzero().flatten().tolist() == [6]  # "6 5 6"
    assert torch.isinf(blocked[1]).nonzero().flatten().tolist() == [9]  # "7 8 9"
    assert torch.isinf(block_repeated_ngrams(torch.zeros(2, 12), words, 1)[1]).sum() == 3
    assert not torch.isinf(block_repeated_ngrams(torch.zeros(2, 12), words[:, :2], 3)).any()


@pytest.mark.parametrize("beam, n", [(1, 1), (1, 2), (3, 2), (3, 3)])
def test_no_repeat_ngram(beam, n):
    dec, features = _decoder(), torch.randn(B, L, D)
    with torch.no_grad():
        dec.readout.bias[END] = -1e4
        dec.readout.bias[[7, 8]] = 30.0  # without blocking: "7 8 7 8 ..." or "7 7 7 ..."
    free = decode(dec, features, DecodeConfig(beam_size=beam, max_length=10), VOCAB)
    assert any(len(set(zip(*(h.tokens[i:] for i in range(n))))) < len(h.tokens) - n + 1 for h in free)
    for hyp in decode(dec, features, DecodeConfig(beam_size=beam, max_length=10, no_repeat_ngram=n), VOCAB):
        grams = list(zip(*(hyp.tokens[i:] for i in range(n))))
        assert len(grams) == len(set(grams)) and len(hyp.tokens) == 10


def test_block_repeated_words_masks_only_the_once_words_already_written():
    words = torch.tensor([[4, 5, 4], [6, 7, 8]])  # (R, t)
    once = torch.zeros(12, dtype=torch.bool)
    once[[4, 6, 9]] = True
    blocked = block_repeated_words(torch.zeros(2, 12), words, once)
    assert torch.isinf(blocked[0]).nonzero().flatten().tolist() == [4]  # 5 written too, but it may repeat
    assert torch.isinf(blocked[1]).nonzero().flatten().tolist() == [6]  # 9 is once-only but not written yet
    assert not torch.isinf(block_repeated_words(torch.zeros(2, 12), words[:, :0], once)).any()


@pytest.mark.parametrize("beam", [1, 3])
def test_no_repeat_words_writes_a_content_word_once_and_lets_function_words_repeat(beam):
    vocab = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "a", "the", *(f"w{i}" for i in range(V - 6))])
    dec, features = _decoder(), torch.randn(B, L, D)
    with torch.no_grad():
        dec.readout.bias[END] = -1e4
        dec.readout.bias[[4, 7]] = 30.0  # without the rule: "a w1 a w1 ..." (or "w1 w1 ...")
    free = decode(dec, features, DecodeConfig(beam_size=beam, max_length=10), vocab)
    assert any(h.tokens.count(7) > 1 for h in free)
    for hyp in decode(dec, features, DecodeConfig(beam_size=beam, max_length=10, no_repeat_words=True), vocab):
        content = [t for t in hyp.tokens if t >= 6]
        assert len(content) == len(set(content)) and len(hyp.tokens) == 10
        assert hyp.tokens.count(4) > 1  # "a" is a function word: it may come back


def test_maps_are_float32_whatever_the_features_dtype():
    dec, features = _decoder().to(torch.bfloat16), torch.randn(B, L, D).bfloat16()
    for hyp in best_of(dec, features, 3, 6, START, END, BANNED):
        assert hyp.alphas.dtype == torch.float32
        torch.testing.assert_close(hyp.alphas.sum(-1), torch.ones(len(hyp.tokens)), atol=1e-6, rtol=0)


@pytest.mark.parametrize("end_bias", [1.0, -1e4])  # captions that end, and ones cut at max_length
def test_n_best_are_distinct_ranked_and_start_with_the_best(end_bias):
    torch.manual_seed(0)
    dec, features = _decoder(end_bias=end_bias), torch.randn(B, L, D)
    cfg = DecodeConfig(beam_size=4, max_length=8)
    ranked = decode_n_best(dec, features, cfg, VOCAB, 3)
    assert sum(len(hyps) == 3 for hyps in ranked) >= B // 2  # fewer only when fewer beams ended
    for hyps, top in zip(ranked, decode(dec, features, cfg, VOCAB)):
        assert 1 <= len(hyps) <= 3 and hyps[0].tokens == top.tokens and hyps[0].score == top.score
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        assert len({tuple(h.tokens) for h in hyps}) == len(hyps)
        assert len({h.finished for h in hyps}) == 1  # finished ones, or (none ended) the live beams
        assert end_bias > 0 or not hyps[0].finished
    with pytest.raises(ValueError, match="n_best 5"):
        decode_n_best(dec, features, cfg, VOCAB, 5)


def test_no_caption_ends_right_after_a_function_word():
    """`decode.no_dangling`: with <end> likely everywhere and "a" among the words, no caption ends
    on "a"; turned off, some do."""
    words = ["<pad>", "<start>", "<end>", "<unk>", "a", *(f"w{i}" for i in range(V - 5))]
    vocab = Vocabulary(words)
    torch.manual_seed(3)
    dec, features = _decoder(end_bias=3.0), torch.randn(B * 4, L, D)
    with torch.no_grad():
        dec.readout.bias[4] += 4.0  # "a" is likely too
    on = decode(dec, features, DecodeConfig(beam_size=3, max_length=8), vocab)
    off = decode(dec, features, DecodeConfig(beam_size=3, max_length=8, no_dangling=False), vocab)
    assert not any(h.finished and h.tokens[-1] == 4 for h in on)
    assert any(h.finished and h.tokens[-1] == 4 for h in off)


def _detecting_decoder() -> AttentionDecoder:
    """`_decoder` with a word detector sure of some words and unsure of others."""
    dec = AttentionDecoder(V, D, dataclasses.replace(CFG, concepts=True), grid=(3, 3)).eval()
    with torch.no_grad():
        dec.readout.weight.mul_(4.0)
        dec.readout.bias[END] += 1.0
        dec.concepts.bias.normal_(-3.0, 2.0, generator=torch.Generator().manual_seed(0))
    return dec


def test_the_detector_weight_adds_its_log_probabilities_to_each_images_content_words():
    """Shallow fusion (`decode.detector_weight`): one image's search equals the plain search of a decoder
    whose readout bias holds w · log p(word) for the content words; in a batch each image gets its own
    (images that leave the batch early take theirs with them)."""
    vocab = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "a", "the", *(f"w{i}" for i in range(V - 6))])
    dec, features = _detecting_decoder(), torch.randn(8, L, D, generator=torch.Generator().manual_seed(2))
    cfg = DecodeConfig(beam_size=3, max_length=10, detector_weight=1.5)
    fused = decode(dec, features, cfg, vocab)
    plain = decode(dec, features, dataclasses.replace(cfg, detector_weight=0.0), vocab)
    assert [h.tokens for h in fused] != [h.tokens for h in plain]
    for i, hyp in enumerate(fused):
        shifted = copy.deepcopy(dec)
        with torch.no_grad():
            log_p = dec.word_log_probs(features[i : i + 1])[0]  # (V,)
            shifted.readout.bias[6:] += 1.5 * log_p[6:]  # the content words: not "a", "the", the specials
        (alone,) = decode(shifted, features[i : i + 1], dataclasses.replace(cfg, detector_weight=0.0), vocab)
        assert hyp.tokens == alone.tokens and hyp.score == pytest.approx(alone.score, abs=1e-4)
    assert len({(len(h.tokens), h.finished) for h in fused}) > 1  # images left the batch at different steps


def test_word_log_probs_read_each_words_detector_output():
    """A grouped word ("man" reading "person") gets its group's probability; the noisy-OR of the regions."""
    dec, features = _detecting_decoder(), torch.randn(2, L, D)
    with torch.no_grad():
        own = dec.word_log_probs(features)  # (2, V)
        scores = torch.sigmoid(dec.concepts(features))  # (2, L, V)
        torch.testing.assert_close(own.exp(), 1 - (1 - scores).prod(dim=1), atol=1e-5, rtol=1e-4)
        dec.detector_slots[7] = 9  # word 7 reads output 9
        grouped = dec.word_log_probs(features)
    torch.testing.assert_close(grouped[:, 7], own[:, 9])
    torch.testing.assert_close(grouped[:, :7], own[:, :7])
    with pytest.raises(ValueError, match="no word detector"):
        _decoder().word_log_probs(features)
