"""Attention grounding: for every generated word that names an object of the image ("circle",
"red"), did the model look at that object when it wrote the word?

Shapes: T words, H' x W' attention grid.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from captioner.data.records import Box
from captioner.model.encoder import Cells


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
    cells: Cells | None = None  # where the cells look (Encoder.cells); None = their nominal centres


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
                 cells: Cells | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Pixel centres of the grid cells in the original image: x (W',) and y (H',).

    The encoder squashes the whole image into its square input (no crop), so cell (r, c) covers
    the same fraction of the original image along each axis. `cells` places them where their
    receptive fields are centred (see `Encoder.cells`); None = the nominal centres (j + 0.5) / n.
    """
    (rows, cols), (width, height) = grid, image_size
    if cells is None:
        return (np.arange(cols) + 0.5) * (width / cols), (np.arange(rows) + 0.5) * (height / rows)
    return cells.centres(cols, width), cells.centres(rows, height)  # (W',), (H',)


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
        xs, ys = cell_centres(attention.shape[1:], s.image_size, s.cells)
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
