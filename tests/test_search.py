import dataclasses
import itertools

import pytest
import torch

from captioner.config import DecodeConfig, DecoderConfig
from captioner.decoder import AttentionDecoder
from captioner.search import beam_search, block_repeated_ngrams, decode, greedy_search, length_penalty
from captioner.vocab import Vocabulary

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


@pytest.mark.parametrize("alpha, ngram", [(0.0, 0), (1.0, 0), (0.7, 2)])
def test_beam_of_one_is_greedy(alpha, ngram):
    dec, features = _decoder(), torch.randn(B, L, D)
    greedy = greedy_search(dec, features, 12, START, END, BANNED, no_repeat_ngram=ngram, length_penalty=alpha)
    beam = beam_search(dec, features, 1, 12, START, END, BANNED, length_penalty=alpha, no_repeat_ngram=ngram)
    for g, b in zip(greedy, beam):
        assert g.tokens == b.tokens and g.finished == b.finished
        assert g.logprob == b.logprob and g.score == b.score  # same float32 sums, bit for bit
        torch.testing.assert_close(g.alphas, b.alphas)


@pytest.mark.parametrize("alpha, ngram", [(1.0, 0), (0.0, 2)])
def test_batched_beam_equals_one_image_at_a_time(alpha, ngram):
    dec, features = _decoder(), torch.randn(8, L, D)
    batched = beam_search(dec, features, 3, 10, START, END, BANNED, length_penalty=alpha, no_repeat_ngram=ngram)
    for i, hyp in enumerate(batched):
        (alone,) = beam_search(dec, features[i : i + 1], 3, 10, START, END, BANNED, length_penalty=alpha,
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
    for hyp, f in zip(beam_search(dec, features, 4, 10, START, END, BANNED, length_penalty=0.5), features):
        assert hyp.alphas.shape == (len(hyp.tokens), L)
        torch.testing.assert_close(hyp.alphas.sum(-1), torch.ones(len(hyp.tokens)))
        logprob, alphas = _teacher_forced(dec, f, hyp.tokens, hyp.finished)
        assert hyp.logprob == pytest.approx(logprob, abs=1e-4)
        assert hyp.score == pytest.approx(hyp.logprob / length_penalty(len(hyp.tokens) + hyp.finished, 0.5))
        torch.testing.assert_close(hyp.alphas, alphas)


def test_wide_beam_finds_the_exhaustive_best():
    """V = 4 specials + 2 words and max_length 2: a 16-wide beam sees every caption."""
    dec, features = _decoder(vocab_size=6, sharpen=1.0), torch.randn(3, L, D)
    for hyp, f in zip(beam_search(dec, features, 16, 2, START, END, BANNED, length_penalty=1.0), features):
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
    hyps = beam_search(dec, features, beam, 5, START, END, BANNED) if beam > 1 else \
        greedy_search(dec, features, 5, START, END, BANNED)
    for hyp, f in zip(hyps, features):
        assert not hyp.finished and len(hyp.tokens) == 5 and hyp.alphas.shape == (5, L)
        assert hyp.logprob == pytest.approx(_teacher_forced(dec, f, hyp.tokens, False)[0], abs=1e-4)


@pytest.mark.parametrize("beam", [1, 4])
def test_specials_are_never_emitted(beam):
    dec, features = _decoder(), torch.randn(B, L, D)
    with torch.no_grad():
        dec.readout.bias[[PAD, START, UNK]] = 50.0  # the model wants nothing but specials
    vocab = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", *(f"w{i}" for i in range(V - 4))])
    for hyp in decode(dec, features, DecodeConfig(beam_size=beam, max_length=8), vocab):
        assert hyp.tokens and not set(hyp.tokens) & {PAD, START, UNK, END}


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
    vocab = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", *(f"w{i}" for i in range(V - 4))])
    free = decode(dec, features, DecodeConfig(beam_size=beam, max_length=10), vocab)
    assert any(len(set(zip(*(h.tokens[i:] for i in range(n))))) < len(h.tokens) - n + 1 for h in free)
    for hyp in decode(dec, features, DecodeConfig(beam_size=beam, max_length=10, no_repeat_ngram=n), vocab):
        grams = list(zip(*(hyp.tokens[i:] for i in range(n))))
        assert len(grams) == len(set(grams)) and len(hyp.tokens) == 10


def test_masked_regions_get_no_attention_and_dtype_device_follow_features():
    dec, features = _decoder(), torch.randn(B, L, D)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[:, 6:] = False
    for hyp in beam_search(dec, features, 3, 6, START, END, BANNED, mask=mask):
        assert torch.all(hyp.alphas[:, 6:] == 0) and hyp.alphas.dtype == features.dtype
