"""Caption metrics (BLEU-1..4, METEOR, ROUGE-L, CIDEr-D) and attention grounding.

The caption metrics are pycocoevalcap's own scorers on pycocoevalcap's own tokenisation (the
Stanford PTBTokenizer, a Java program), so the numbers are the ones papers report. Without Java
the captions are tokenised with `captioner.vocab.tokenize` instead and METEOR (also Java) is
skipped, with a log line saying so. pycocoevalcap's `Cider` is CIDEr-D (clipped counts, length
penalty, sigma 6); its document frequencies come from the references of the evaluated set.

Grounding asks, for every generated word that names an object of the image ("circle", "red"),
whether the model looked at that object when it wrote the word.

Shapes: T words, H' x W' attention grid.
"""
from __future__ import annotations

import logging
import math
import shutil
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from captioner.sources import Box
from captioner.vocab import tokenize

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
    gts = {i: tokens[("ref", k)] for i, k in enumerate(keys)}
    res = {i: tokens[("hyp", k)] for i, k in enumerate(keys)}

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


def _meteor(gts: dict[int, list[str]], res: dict[int, list[str]]) -> float:
    from pycocoevalcap.meteor import meteor

    scorer = meteor.Meteor()  # starts a JVM (about 10 s to load); its __del__ stops it
    try:
        return float(scorer.compute_score(gts, res)[0])
    finally:
        del scorer


# --- attention grounding ---------------------------------------------------------------------


@dataclass(frozen=True)
class GroundingSample:
    """One captioned image with its objects.

    words: the generated words, in order.
    attention: (T, H', W') the attention map of each word (rows sum to 1).
    image_size: (width, height) of the original image, the pixels the boxes are in.
    boxes: the image's objects; a label like "red circle" names the object by each of its words.
    """

    words: Sequence[str]
    attention: np.ndarray
    image_size: tuple[int, int]
    boxes: Sequence[Box]
    cell_offset: float = 0.0  # where the cells' receptive fields are centred, in cells (Encoder.cell_offset)


@dataclass(frozen=True)
class GroundingResult:
    """hit_rate: share of grounded words whose attention peak lies in their object's box.
    mean_mass: mean attention mass inside that box. words: how many words were grounded
    (0 -> both rates are 0.0)."""

    hit_rate: float
    mean_mass: float
    words: int


def word_objects(words: Sequence[str], boxes: Sequence[Box]) -> list[int | None]:
    """For each word, the index of the box it names, or None.

    A word names the boxes whose label contains it. When it names more than one (two circles), the
    phrase it stands in decides: the run of consecutive label words around it ("red circle"), and
    the box whose label shares most of that run's words wins; a tie is skipped (None).
    """
    labels = [set(b.label.split()) for b in boxes]
    label_words = set().union(*labels) if labels else set()
    result: list[int | None] = []
    for i, word in enumerate(words):
        named = [j for j, lab in enumerate(labels) if word in lab]
        if len(named) > 1:
            lo, hi = i, i + 1
            while lo > 0 and words[lo - 1] in label_words:
                lo -= 1
            while hi < len(words) and words[hi] in label_words:
                hi += 1
            phrase = set(words[lo:hi])
            overlap = [len(labels[j] & phrase) for j in named]
            best = max(overlap)
            named = [j for j, o in zip(named, overlap) if o == best]
        result.append(named[0] if len(named) == 1 else None)
    return result


def cell_centres(grid: tuple[int, int], image_size: tuple[int, int],
                 offset: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Pixel centres of the grid cells in the original image: x (W',) and y (H',).

    The encoder squashes the whole image into its square input (no crop), so cell (r, c) covers
    the same fraction of the original image along each axis; `offset` (in cells) moves the centres
    to where the cells' receptive fields are centred (see `Encoder.cell_offset`).
    """
    (rows, cols), (width, height) = grid, image_size
    xs = (np.arange(cols) + 0.5 + offset) * (width / cols)  # (W',)
    ys = (np.arange(rows) + 0.5 + offset) * (height / rows)  # (H',)
    return xs, ys


def grounding_score(samples: Iterable[GroundingSample]) -> GroundingResult:
    """Attention grounding over captions: peak-in-box hit rate and attention mass in the box.

    Args:
        samples: captions with their per-word attention maps and the images' boxes.
    Returns:
        GroundingResult over all words that name exactly one object (see `word_objects`).
    """
    hits, masses = 0, []
    for s in samples:
        attention = np.asarray(s.attention, dtype=np.float64)  # (T, H', W')
        if attention.ndim != 3 or attention.shape[0] != len(s.words):
            raise ValueError(f"grounding: attention of shape {attention.shape} for {len(s.words)} words")
        xs, ys = cell_centres(attention.shape[1:], s.image_size, s.cell_offset)
        for t, j in enumerate(word_objects(s.words, s.boxes)):
            if j is None:
                continue
            box = s.boxes[j]
            inside = np.outer((ys >= box.y0) & (ys <= box.y1), (xs >= box.x0) & (xs <= box.x1))  # (H', W')
            peak = np.unravel_index(int(np.argmax(attention[t])), attention.shape[1:])
            hits += bool(inside[peak])
            masses.append(float(attention[t][inside].sum()))
    if not masses:
        return GroundingResult(0.0, 0.0, 0)
    return GroundingResult(hits / len(masses), float(math.fsum(masses) / len(masses)), len(masses))
