import numpy as np
import pytest
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider
from pycocoevalcap.rouge.rouge import Rouge

from captioner.data.vocab import tokenize
from captioner.decoding import metrics
from captioner.decoding.metrics import caption_metrics

REFS = {
    "dog.jpg": ["A dog runs on the grass.", "a brown dog running", "The dog is playing outside, happily!"],
    7: ["Two men ride bikes down a hill.", "Men on bicycles."],
    "shapes-1": ["a red circle", "there is a red circle", "one red circle"],
}
HYPS = {"dog.jpg": "A dog is running on the grass.", 7: "two men riding bicycles down a hill", "shapes-1": "a red square"}
needs_java = pytest.mark.skipif(not metrics.java_available(), reason="java not on PATH")


def _reference_scores(gts, res):
    """pycocoevalcap called the way its own COCOEvalCap calls it."""
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    return {**{f"Bleu_{i + 1}": b for i, b in enumerate(bleu)},
            "ROUGE_L": Rouge().compute_score(gts, res)[0], "CIDEr": Cider().compute_score(gts, res)[0]}


@needs_java
def test_scores_equal_pycocoevalcap_with_its_tokenizer():
    gts, res = _ptb(REFS, HYPS)
    expected = _reference_scores(gts, res)
    got = caption_metrics(REFS, HYPS, meteor=False)
    assert list(got) == ["Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "ROUGE_L", "CIDEr"]
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name
    assert 0 < got["Bleu_4"] < got["Bleu_1"] <= 1 and got["CIDEr"] > 0


def test_without_java_our_tokenizer_is_used_and_meteor_skipped(monkeypatch, caplog):
    monkeypatch.setattr(metrics, "java_available", lambda: False)
    gts = {k: [" ".join(tokenize(c)) for c in v] for k, v in REFS.items()}
    res = {k: [" ".join(tokenize(HYPS[k]))] for k in REFS}
    got = caption_metrics(REFS, HYPS)
    assert "METEOR" not in got and "METEOR skipped" in caplog.text
    for name, value in _reference_scores(gts, res).items():
        assert got[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name


def _ptb(refs, hyps):
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    tok = PTBTokenizer()
    gts = tok.tokenize({k: [{"caption": c} for c in v] for k, v in refs.items()})
    res = tok.tokenize({k: [{"caption": hyps[k]}] for k in refs})
    return gts, res


@needs_java
def test_an_empty_caption_does_not_shift_the_others():
    hyps = {"dog.jpg": HYPS["dog.jpg"], "shapes-1": "", 7: HYPS[7]}  # empty in the middle, and last
    gts, res = _ptb(REFS, HYPS)
    res["shapes-1"] = [""]
    got = caption_metrics(REFS, hyps, meteor=False)
    for name, value in _reference_scores(gts, res).items():
        assert got[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name


def test_hypotheses_need_references():
    with pytest.raises(ValueError, match="no references"):
        caption_metrics(REFS, {"other.jpg": "a cat"}, meteor=False)


@pytest.mark.slow
@needs_java
def test_meteor_equals_pycocoevalcap(monkeypatch):
    import pycocoevalcap.meteor.meteor as meteor_module

    scorer = meteor_module.Meteor()  # one JVM (about 10 s to load) serves both sides
    monkeypatch.setattr(meteor_module, "Meteor", lambda: scorer)
    got = caption_metrics(REFS, HYPS)["METEOR"]
    assert got == pytest.approx(scorer.compute_score(*_ptb(REFS, HYPS))[0], abs=1e-12) and 0 < got < 1


@pytest.mark.parametrize("java", [True, False])
def test_fixed_numbers_for_a_fixed_example(java, monkeypatch):
    """Worked by hand. "a dog runs" against "a cat runs fast": 2 of 3 unigrams match, 0 of 2 bigrams;
    the hypothesis is shorter (3 words, reference 4), so BLEU-1 = 2/3 * exp(1 - 4/3) = 0.4777. A
    hypothesis equal to its reference scores 1 on BLEU-4 and ROUGE-L."""
    if java and not metrics.java_available():
        pytest.skip("java not on PATH")
    monkeypatch.setattr(metrics, "java_available", lambda: java)
    refs = {"a": ["a cat runs fast"], "b": ["two birds sit on a wire"]}
    got = caption_metrics(refs, {"a": "a dog runs", "b": "two birds sit on a wire"}, meteor=False)
    # corpus BLEU-1: (2 + 6) matching of (3 + 6) words, brevity penalty exp(1 - 10/9)
    assert got["Bleu_1"] == pytest.approx(8 / 9 * np.exp(1 - 10 / 9), rel=1e-6)
    alone = caption_metrics({"a": refs["a"]}, {"a": "a dog runs"}, meteor=False)
    assert alone["Bleu_1"] == pytest.approx(2 / 3 * np.exp(1 - 4 / 3), rel=1e-6)
    same = caption_metrics({"b": refs["b"]}, {"b": "two birds sit on a wire"}, meteor=False)
    assert same["Bleu_4"] == pytest.approx(1.0, rel=1e-6) and same["ROUGE_L"] == pytest.approx(1.0)
    # ROUGE-L of "a dog runs" vs "a cat runs fast": LCS 2 ("a runs"), P = 2/3, R = 2/4, beta 1.2
    p, r, beta = 2 / 3, 2 / 4, 1.2
    assert alone["ROUGE_L"] == pytest.approx((1 + beta**2) * p * r / (r + beta**2 * p), rel=1e-6)


def test_the_config_names_exactly_the_metrics_computed():
    import typing

    from captioner.config.schema import MetricName

    assert typing.get_args(MetricName) == metrics.METRIC_NAMES


def test_diversity_counts_dangling_endings_and_distinct_words_and_captions():
    got = metrics.diversity(["A man riding a", "a man riding a horse.", "a man riding a horse", "dogs play in"])
    assert got == {"dangling": 0.5, "distinct_words": 7.0, "distinct_captions": 3.0}  # a man riding horse dogs play in


def test_per_image_cider_averages_to_the_corpus_cider_and_follows_each_caption():
    per_image = metrics.cider_per_image(REFS, HYPS)
    assert len(per_image) == 3 and np.mean(per_image) == pytest.approx(caption_metrics(REFS, HYPS, meteor=False)["CIDEr"])
    worse = metrics.cider_per_image(REFS, {**HYPS, 7: "a red circle"})
    assert worse[1] < per_image[1] and worse[0] == pytest.approx(per_image[0]) and worse[2] == pytest.approx(per_image[2])


def test_attention_focus_is_the_peak_as_a_multiple_of_an_even_spread():
    even, one_cell = np.full((4, 4), 1 / 16), np.eye(1, 16).reshape(4, 4)
    half = np.zeros((4, 4))
    half[0, :2] = 0.5  # 8x an even spread: not above the line
    focus = metrics.attention_focus([even, one_cell, half, even])
    assert focus["peak_median"] == pytest.approx(4.5) and focus["focused"] == pytest.approx(0.25)
    assert metrics.attention_focus([one_cell])["peak_p90"] == pytest.approx(16.0) and metrics.attention_focus([]) == {}
