"""Teacher forcing at inference (`decoding/forced.py`, `Captioner.caption(text=)`, `--text`): a given
caption scores and looks exactly as the model does when it writes those words itself."""
import dataclasses
import json

import numpy as np
import PIL.Image
import pytest
import torch

from captioner.cli import main
from captioner.config import Config, DecoderConfig, EncoderConfig, ModelConfig
from captioner.data.vocab import SPECIALS, Vocabulary, build_vocabulary, tokenize
from captioner.decoding.captioner import Captioner
from captioner.decoding.ensemble import EnsembleDecoder
from captioner.decoding.forced import TextError, force_text, teacher_force, text_ids
from captioner.decoding.search import beam_search
from captioner.model import build_model
from captioner.model.checkpoint import save_checkpoint
from captioner.model.decoder import AttentionDecoder

N, L, D, V = 5, 9, 16, 30
PAD, START, END, UNK = 0, 1, 2, 3
BANNED = (PAD, START, UNK)
CFG = DecoderConfig(embed_dim=8, hidden_dim=12, attention_dim=10, dropout=0.0, feature_dim=0)
VOCAB = Vocabulary([*SPECIALS, *(f"w{i}" for i in range(4, V))])
LAYOUTS = {"before-mean": {"attend": "before"}, "after-none": {"attend": "after", "init_pooling": "none"},
           "before-attention": {"attend": "before", "init_pooling": "attention"}}


def _decoder(end_bias: float = 2.0, **layout) -> AttentionDecoder:
    """A random decoder with peaked word distributions (no near-ties) whose captions end after a few words."""
    dec = AttentionDecoder(V, D, dataclasses.replace(CFG, **layout), grid=(3, 3)).eval()
    with torch.no_grad():
        dec.readout.weight.mul_(4.0)
        dec.readout.bias[END] += end_bias
        dec.attention.score.weight.mul_(10.0)  # maps that differ from step to step
    return dec


def _captions(*words: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`[<start>, w.., <end>, <pad>..]` rows (B, T + 2) and their lengths (words + <end>)."""
    T = max(len(w) for w in words)
    tokens = torch.tensor([[START, *w, END] + [PAD] * (T - len(w)) for w in words])
    return tokens, torch.tensor([len(w) + 1 for w in words])


# --- teacher_force -------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_greedy_caption_forced_scores_and_looks_as_the_search_did(layout):
    dec, features = _decoder(**LAYOUTS[layout]), torch.randn(N, L, D)
    # min_length: <end> barred before 3 words (set to -inf after the softmax, so each word keeps its probability)
    hyps = [ranked[0] for ranked in beam_search(dec, features, 1, 10, START, END, BANNED, length_penalty=0.7,
                                                min_length=3)]
    assert any(h.finished and len(h.tokens) >= 2 for h in hyps)  # the comparison covers words and <end>
    forced = teacher_force(dec, features, *_captions(*(h.tokens for h in hyps)))
    for b, h in enumerate(hyps):
        T = len(h.tokens)
        scored = forced.logprobs[b, : T + int(h.finished)].sum().item()  # the words, and <end> when the search wrote it
        assert scored == pytest.approx(h.logprob, abs=1e-5)
        torch.testing.assert_close(forced.alphas[b, :T], h.alphas, atol=1e-6, rtol=0)
        if h.finished:  # force_text's Hypothesis is the search's, word for word
            (again,) = force_text(dec, features[b : b + 1], h.tokens, VOCAB, exponent=0.7)
            assert again.tokens == h.tokens and again.finished
            assert again.logprob == pytest.approx(h.logprob, abs=1e-5) and again.score == pytest.approx(h.score, abs=1e-5)
            assert sum(again.word_logprobs) == pytest.approx(forced.logprobs[b, :T].sum().item(), abs=1e-5)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forcing_equals_the_packed_training_pass(layout):
    """Two independent implementations of the same teacher forcing: step by step and packed."""
    dec, features = _decoder(**LAYOUTS[layout]), torch.randn(2, L, D)
    tokens, lengths = _captions([5, 6, 7], [8], [9, 10, 11, 12])
    rows = torch.tensor([0, 1, 0])
    forced = teacher_force(dec, features, tokens, lengths, rows)
    with torch.no_grad():
        out = dec(features, tokens, lengths, rows)
    logp = torch.log_softmax(out.logits, -1).gather(1, tokens[out.caption, out.step + 1, None]).squeeze(1)  # (P,)
    torch.testing.assert_close(forced.logprobs, out.padded(logp, 3, 5), atol=1e-5, rtol=0)
    torch.testing.assert_close(forced.alphas, out.padded(out.alphas, 3, 5), atol=1e-6, rtol=0)


def test_maps_sum_to_one_and_padding_is_zero():
    dec, features = _decoder(), torch.randn(2, L, D)
    tokens, lengths = _captions([5, 6, 7, 8], [9], [10, 11])
    forced = teacher_force(dec, features, tokens, lengths, rows=torch.tensor([1, 0, 1]))
    assert forced.logprobs.shape == (3, 5) and forced.alphas.shape == (3, 5, L)
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(forced.alphas[b, :n].sum(-1), torch.ones(n))
        assert bool((forced.logprobs[b, :n] < 0).all())
        assert not forced.alphas[b, n:].any() and not forced.logprobs[b, n:].any()


def test_a_batch_equals_each_caption_alone():
    dec, features = _decoder(), torch.randn(2, L, D)
    words = [[5, 6, 7, 8, 9], [10, 11]]
    together = teacher_force(dec, features, *_captions(*words))
    for b, w in enumerate(words):
        alone = teacher_force(dec, features[b : b + 1], *_captions(w))
        n = len(w) + 1
        torch.testing.assert_close(together.logprobs[b, :n], alone.logprobs[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(together.alphas[b, :n], alone.alphas[0], atol=1e-6, rtol=0)


def test_a_pad_the_model_rules_out_scores_zero_not_nan():
    """A decoder that gives <pad> no probability at all (-inf, as an ensemble's log-probs can): the
    padded positions of a shorter caption must still read 0."""
    dec = _decoder()
    with torch.no_grad():
        dec.readout.bias[PAD] = float("-inf")
    forced = teacher_force(dec, torch.randn(2, L, D), *_captions([5, 6, 7], [8]))
    assert torch.isfinite(forced.logprobs).all() and torch.isfinite(forced.alphas).all()
    assert forced.logprobs[1, 2:].eq(0).all()


def test_an_ensemble_of_a_decoder_with_itself_forces_as_the_decoder():
    dec, features = _decoder(), torch.randn(2, L, D)
    captions = _captions([5, 6, 7], [8, 9])
    alone, twice = teacher_force(dec, features, *captions), teacher_force(EnsembleDecoder([dec, dec]), features, *captions)
    torch.testing.assert_close(twice.logprobs, alone.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(twice.alphas, alone.alphas, atol=1e-6, rtol=0)


# --- text_ids --------------------------------------------------------------------------------------


def test_text_is_tokenised_as_captions_are():
    vocab = Vocabulary([*SPECIALS, "a", "dog", "'s", "ball"])
    assert text_ids("A dog's BALL.", vocab) == [vocab.id(w) for w in ["a", "dog", "'s", "ball"]]


def test_unknown_words_are_named_once_each_in_one_line():
    vocab = Vocabulary([*SPECIALS, "a", "dog", "catches", *(f"w{i}" for i in range(2528))])
    with pytest.raises(TextError) as e:
        text_ids("a dog catches a frisbeee, zorb and a zorb", vocab)
    assert str(e.value) == "text: 'frisbeee', 'zorb', 'and' not in the model's vocabulary (2,531 words)"


@pytest.mark.parametrize("text", ["", "   ", "... !"])
def test_a_text_without_words_is_one_line(text):
    with pytest.raises(TextError, match=r"^text .*: no words to caption with$"):
        text_ids(text, VOCAB)


# --- Captioner.caption(text=) ---------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path):
    """An untrained model of 16 words (test_captioner's)."""
    vocab = build_vocabulary(CAPTIONS)
    model = build_model(MODEL, len(vocab), pretrained=False)
    with torch.no_grad():
        model.decoder.readout.weight.mul_(4.0)  # peaked word distributions: no near-ties
    return save_checkpoint(tmp_path / "tiny.pt", Config(model=MODEL), vocab, model.state_dict())


def _image(seed: int, size=(80, 60)) -> PIL.Image.Image:
    rng = np.random.default_rng(seed)
    return PIL.Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


CAPTIONS = ["a red circle to the left of a blue square", "a green triangle above a yellow circle",
            "there is a purple square"]
MODEL = ModelConfig(encoder=EncoderConfig(name="random", image_size=64),
                    decoder=DecoderConfig(embed_dim=16, hidden_dim=32, attention_dim=16, dropout=0.0))
TEXT = "A red circle, left of the blue square."
WORDS = tokenize(TEXT)


def test_caption_with_text_gives_those_words_their_maps_and_log_probabilities(checkpoint):
    captioner = Captioner.from_checkpoint(checkpoint, device="cpu")
    images = [_image(i, (80 + 10 * i, 60)) for i in range(3)]
    captions = captioner.caption(images, batch_size=2, text=TEXT, length_penalty=0.5)
    T = len(WORDS)
    for c, im in zip(captions, images):
        assert c.tokens == WORDS and c.text == " ".join(WORDS) and c.finished and c.image_size == im.size
        assert c.attention.shape == (T, 4, 4)
        np.testing.assert_allclose(c.attention.sum(axis=(1, 2)), 1.0, rtol=0, atol=1e-6)
        assert len(c.word_logprobs) == T and all(lp < 0 for lp in c.word_logprobs)
        assert c.logprob < sum(c.word_logprobs)  # <end>'s log-probability is in the sum too
        assert c.score == pytest.approx(c.logprob / (T + 1) ** 0.5)
        assert c.to_json()["word_logprobs"] == c.word_logprobs and not c.alternatives
    assert captions[0].word_logprobs != captions[1].word_logprobs  # each image scored on its own grid
    together = captioner.caption(images, batch_size=3, text=TEXT, length_penalty=0.5)
    np.testing.assert_allclose([c.word_logprobs for c in together], [c.word_logprobs for c in captions], atol=1e-5)


def test_the_caption_the_model_writes_forced_back_has_its_maps_and_log_probability(checkpoint):
    captioner = Captioner.from_checkpoint(checkpoint, device="cpu")
    (written,) = captioner.caption([_image(0)], beam_size=1, max_length=8)
    assert written.word_logprobs is None and written.to_json()["word_logprobs"] is None
    (given,) = captioner.caption([_image(0)], text=written.text)
    assert given.tokens == written.tokens
    np.testing.assert_allclose(given.attention, written.attention, atol=1e-6)
    scored = given.logprob if written.finished else sum(given.word_logprobs)
    assert scored == pytest.approx(written.logprob, abs=1e-5)


def test_an_ensemble_forces_a_text_as_its_one_model(checkpoint):
    alone = Captioner.from_checkpoint(checkpoint, device="cpu").caption([_image(1)], text=TEXT)[0]
    twice = Captioner.from_checkpoint([checkpoint, checkpoint], device="cpu").caption([_image(1)], text=TEXT)[0]
    np.testing.assert_allclose(twice.word_logprobs, alone.word_logprobs, atol=1e-5)
    np.testing.assert_allclose(twice.attention, alone.attention, atol=1e-6)


def test_unknown_words_stop_before_any_image_is_read(checkpoint, tmp_path):
    captioner = Captioner.from_checkpoint(checkpoint, device="cpu")
    with pytest.raises(TextError, match=r"^text: 'frisbee' not in the model's vocabulary \(16 words\)$"):
        captioner.caption([tmp_path / "missing.png"], text="a red frisbee")
    with pytest.raises(TextError):
        next(captioner.caption_files([str(tmp_path / "missing.png")], text="frisbee"))
    with pytest.raises(ValueError, match="alternatives"):
        captioner.caption([_image(0)], text="a red circle", beam_size=3, alternatives=1)


# --- CLI -------------------------------------------------------------------------------------------


def test_cli_caption_text_shows_each_word_with_its_log_probability(checkpoint, tmp_path, capsys):
    paths = [tmp_path / f"im{i}.png" for i in range(2)]
    for i, p in enumerate(paths):
        _image(i).save(p)
    expected = Captioner.from_checkpoint(checkpoint, device="cpu").caption(paths, text=TEXT)
    assert main(["caption", *map(str, paths), "--checkpoint", str(checkpoint), "--text", TEXT, "--device", "cpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for line, path, c in zip(lines, paths, expected):
        where, text, scores = line.split("\t")
        assert (where, text) == (str(path), " ".join(WORDS))
        pairs = scores.split("  ")
        assert [p.split(" ")[0] for p in pairs[:-1]] == [*WORDS, "<end>"]
        assert [float(p.split(" ")[1]) for p in pairs[: len(WORDS)]] == pytest.approx(c.word_logprobs, abs=0.006)
        assert pairs[-1] == f"(sum {c.logprob:.2f})"
    assert main(["caption", str(paths[0]), "--checkpoint", str(checkpoint), "--text", TEXT, "--json",
                 "--device", "cpu"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["tokens"] == WORDS and np.array(row["attention"]).shape == (len(WORDS), 4, 4)
    assert row["word_logprobs"] == pytest.approx(expected[0].word_logprobs, abs=1e-6)


def test_cli_unknown_words_are_one_line_and_a_failure(checkpoint, tmp_path, capsys):
    _image(0).save(tmp_path / "im.png")
    for command in (["caption", str(tmp_path / "im.png")], ["visualize", str(tmp_path / "im.png"), "-o",
                                                              str(tmp_path / "out.png")]):
        code = main([*command, "--checkpoint", str(checkpoint), "--text", "a dog catches a frisbee", "--device", "cpu"])
        out, err = capsys.readouterr()
        assert code == 2 and out == ""
        assert err == "captioner: error: text: 'dog', 'catches', 'frisbee' not in the model's vocabulary (16 words)\n"
    assert not (tmp_path / "out.png").exists()


def test_cli_visualize_text_draws_the_given_words(checkpoint, tmp_path, capsys):
    _image(0).save(tmp_path / "im.png")
    code = main(["visualize", str(tmp_path / "im.png"), "--checkpoint", str(checkpoint), "--text", "a blue square",
                 "-o", str(tmp_path / "out.png"), "--per-word", str(tmp_path / "words"), "--device", "cpu"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and out[0].startswith(f"{tmp_path / 'im.png'}\ta blue square\ta ")
    assert PIL.Image.open(tmp_path / "out.png").size[0] > 100
    assert sorted(p.name for p in (tmp_path / "words").iterdir()) == ["01_a.png", "02_blue.png", "03_square.png"]
