"""Caption metrics: BLEU-1..4, METEOR, ROUGE-L, CIDEr-D.

The caption metrics are pycocoevalcap's own scorers on pycocoevalcap's own tokenisation (the
Stanford PTBTokenizer, a Java program), so the numbers are the ones papers report. Without Java
the captions are tokenised with `captioner.data.vocab.tokenize` instead and METEOR (also Java) is
skipped, with a log line saying so. pycocoevalcap's `Cider` is CIDEr-D (clipped counts, length
penalty, sigma 6); its document frequencies come from the references of the evaluated set.
"""
from __future__ import annotations

import logging
import shutil
from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from captioner.data.vocab import FUNCTION_WORDS, tokenize

log = logging.getLogger(__name__)

METRIC_NAMES: tuple[str, ...] = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr")


def java_available() -> bool:
    """True when a `java` executable is on PATH (PTBTokenizer and METEOR need it)."""
    return shutil.which("java") is not None


def _ptb_tokenize(captions: dict[Hashable, list[str]]) -> dict[Hashable, list[str]]:
    """pycocoevalcap's PTBTokenizer (one Java run) over {key: [caption, ...]}; every key comes back."""
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    # The Java tokenizer reads one caption per line; an empty caption would shift the lines that follow.
    safe = {k: [{"caption": c.replace("\n", " ") if c.strip() else "."} for c in v] for k, v in captions.items()}
    out = PTBTokenizer().tokenize(safe)  # "." is punctuation: it comes back as ""
    return {k: out.get(k, [""] * len(v)) for k, v in captions.items()}


def _simple_tokenize(captions: dict[Hashable, list[str]]) -> dict[Hashable, list[str]]:
    return {k: [" ".join(tokenize(c)) for c in v] for k, v in captions.items()}


def caption_metrics(
    references: Mapping[str | int, Sequence[str]],
    hypotheses: Mapping[str | int, str],
    meteor: bool | None = None,
) -> dict[str, float]:
    """Corpus-level caption metrics through pycocoevalcap.

    Args:
        references: image key -> its reference captions (raw text, at least one).
        hypotheses: image key -> the generated caption (raw text). Every key needs references;
            images without a hypothesis are not scored.
        meteor: compute METEOR; None = when Java is available. Without Java it is skipped (logged).
    Returns:
        {"Bleu_1".."Bleu_4", "METEOR" (when computed), "ROUGE_L", "CIDEr"} as floats.
    """
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge

    gts, res = _tokenized(references, hypotheses)
    java = java_available()
    scores: dict[str, float] = {}
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    scores.update({f"Bleu_{n}": float(b) for n, b in enumerate(bleu, start=1)})
    want_meteor = java if meteor is None else meteor
    if want_meteor and java:
        scores["METEOR"] = _meteor(gts, res)
    elif want_meteor or meteor is None:
        log.warning("METEOR skipped: it needs Java (`java` is not on PATH)")
    scores["ROUGE_L"] = float(Rouge().compute_score(gts, res)[0])
    scores["CIDEr"] = float(Cider().compute_score(gts, res)[0])
    return {k: scores[k] for k in METRIC_NAMES if k in scores}


def cider_per_image(references: Mapping[str | int, Sequence[str]], hypotheses: Mapping[str | int, str]) -> list[float]:
    """pycocoevalcap's CIDEr-D of each hypothesis (in `hypotheses` order; their mean is `caption_metrics`'
    "CIDEr"), for paired comparisons of two models image by image."""
    from pycocoevalcap.cider.cider import Cider

    gts, res = _tokenized(references, hypotheses)
    return [float(x) for x in Cider().compute_score(gts, res)[1]]


def _tokenized(references: Mapping[str | int, Sequence[str]],
               hypotheses: Mapping[str | int, str]) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
    """References and hypotheses tokenised as pycocoevalcap expects, keyed 0..n-1 in `hypotheses` order."""
    if not hypotheses:
        raise ValueError("caption_metrics: no hypotheses to score")
    missing = [k for k in hypotheses if not references.get(k)]
    if missing:
        raise ValueError(f"caption_metrics: {len(missing)} hypotheses have no references (e.g. {missing[0]!r})")
    keys = list(hypotheses)
    # One tokeniser run for both sides: keys ("ref", k) and ("hyp", k).
    raw = {**{("ref", k): list(references[k]) for k in keys}, **{("hyp", k): [hypotheses[k]] for k in keys}}
    java = java_available()
    tokens = _ptb_tokenize(raw) if java else _simple_tokenize(raw)
    if not java:
        log.info("java not found: captions tokenised with captioner.vocab.tokenize instead of the PTBTokenizer")
    return ({i: tokens[("ref", k)] for i, k in enumerate(keys)}, {i: tokens[("hyp", k)] for i, k in enumerate(keys)})


def _meteor(gts: dict[int, list[str]], res: dict[int, list[str]]) -> float:
    from pycocoevalcap.meteor import meteor

    scorer = meteor.Meteor()  # starts a JVM (about 10 s to load); its __del__ stops it
    try:
        return float(scorer.compute_score(gts, res)[0])
    finally:
        del scorer


def diversity(captions: Sequence[str]) -> dict[str, float]:
    """What self-critical training is known to break, measured on generated captions:
    `dangling`, the share that ends on a function word ("a man riding a"); `distinct_words` in
    all of them; `distinct_captions`, how many different captions (vocabulary collapse shrinks both)."""
    tokens = [tokenize(c) for c in captions]
    return {
        "dangling": sum(bool(t) and t[-1] in FUNCTION_WORDS for t in tokens) / max(len(tokens), 1),
        "distinct_words": float(len({w for t in tokens for w in t})),
        "distinct_captions": float(len({" ".join(t) for t in tokens})),
    }


FOCUSED = 8.0  # a word whose map peaks at 8x an even spread looks somewhere in particular


def attention_focus(maps: Sequence[np.ndarray]) -> dict[str, float]:
    """How sharply the model looks, from each word's attention map (any shape, summing to 1): the
    peak weight as a multiple of an even spread (1 = uniform, L = all on one of L cells), its median
    and 90th percentile over the words, and the share of words above FOCUSED. Needs no boxes, so it
    works on any photos (the grounding score needs object boxes)."""
    if not maps:
        return {}
    peaks = np.array([float(m.max()) * m.size for m in maps])
    return {"peak_median": float(np.median(peaks)), "peak_p90": float(np.percentile(peaks, 90)),
            "focused": float((peaks > FOCUSED).mean())}
