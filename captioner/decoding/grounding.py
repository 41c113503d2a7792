"""Attention grounding: for every word that names a boxed object of its photo ("dog", "red"), did
the model look at that object when it wrote the word? The pointing game, scored two ways:

- hit: the peak cell's receptive-field centre (`Encoder.cells`) lies inside one of the object's
  boxes, within the pointing game's tolerance of 15 px at 500 px (scaled to the photo);
- mass: the map's weight on the cells whose centres lie inside a box;

each beside its baseline on the same words (a pointer fixed at the photo's centre; an even map),
overall, by the share of the photo the object covers, and per word. Over captions that name two or
more different boxed objects it also counts how often each object's word peaks inside its own box,
from a cell of its own: a map that stares at one thing for every word fails that.

Shapes: T words, H' x W' attention grid.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np

from captioner.data.boxes import BoxXYXY, GroundObject
from captioner.model.grid import Cells

TOLERANCE = 15 / 500  # of the photo's longer side: the pointing game's 15 px at 500 px
SMALL = 0.25  # an object covering less than this share of the photo is "small"


@dataclass(frozen=True)
class GroundingSample:
    """One caption of a photo with its objects.

    words: the caption's words, in order.
    attention: (T, H', W') the map of the step that wrote each word (each sums to 1).
    image_size: (width, height) of the photo, the pixels the boxes are in.
    objects: the photo's boxed objects.
    cells: where the cells look (`Encoder.cells`); None = their nominal centres.
    """

    words: Sequence[str]
    attention: np.ndarray
    image_size: tuple[int, int]
    objects: Sequence[GroundObject]
    cells: Cells | None = None


@dataclass(frozen=True)
class Pointing:
    """Figures over a set of object words: the model's hit rate and mean mass in the box, and the
    baselines on the same words (a pointer at the photo's centre; an even map). words = 0 -> all 0."""

    words: int
    hit_rate: float
    mean_mass: float
    centre_hit_rate: float
    even_mass: float


@dataclass(frozen=True)
class GroundingResult:
    """all / small / large: over every object word, those of objects under / over SMALL of the photo.
    by_word: per word, most frequent first. multi_captions: captions naming two or more different
    boxed objects; multi_own_box: the share of them where each object's (first) word peaks inside
    its own box from a different cell. distinct_peaks: per caption, distinct peak cells / words
    (1 = every word looks somewhere else; low = every word stares at one spot), averaged."""

    all: Pointing
    small: Pointing
    large: Pointing
    by_word: dict[str, Pointing]
    multi_captions: int
    multi_own_box: float
    distinct_peaks: float

    @property
    def hit_rate(self) -> float:
        return self.all.hit_rate

    @property
    def mean_mass(self) -> float:
        return self.all.mean_mass

    @property
    def words(self) -> int:
        return self.all.words

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Look(NamedTuple):
    """One object word's map against its object's boxes."""

    word: str
    hit: bool
    mass: float
    centre_hit: bool
    even_mass: float
    share: float  # of the photo the object's boxes cover
    peak: tuple[int, int]  # (row, column) of the peak cell


def word_objects(words: Sequence[str], objects: Sequence[GroundObject]) -> list[tuple[int, ...] | None]:
    """For each word, the indices of the objects it names, or None.

    A word names an object when one of its names ends at that word ("ball", or "tennis ball" after
    "tennis"). When it names several, the phrase it stands in decides: the run of consecutive name
    words around it ("red circle"), and the objects whose names share most of that run's words win;
    objects still tied are all meant (either may be the one), so a look at any of them counts.
    """
    tokens = [frozenset(w for name in o.names for w in name.split()) for o in objects]
    name_words = frozenset().union(*tokens) if tokens else frozenset()
    result: list[tuple[int, ...] | None] = []
    for i, word in enumerate(words):
        named = [j for j, o in enumerate(objects) if any(_ends_at(name.split(), words, i) for name in o.names)]
        if len(named) > 1:
            lo, hi = i, i + 1
            while lo > 0 and words[lo - 1] in name_words:
                lo -= 1
            while hi < len(words) and words[hi] in name_words:
                hi += 1
            phrase = set(words[lo:hi])
            overlap = [len(tokens[j] & phrase) for j in named]
            named = [j for j, o in zip(named, overlap) if o == max(overlap)]
        result.append(tuple(named) if named else None)
    return result


def _ends_at(name: list[str], words: Sequence[str], i: int) -> bool:
    return i + 1 >= len(name) and list(words[i + 1 - len(name) : i + 1]) == name


def cell_centres(grid: tuple[int, int], image_size: tuple[int, int],
                 cells: Cells | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Pixel centres of the grid cells in the photo: x (W',) and y (H',).

    The encoder squashes the whole photo into its square input (no crop), so cell (r, c) covers the
    same fraction of the photo along each axis. `cells` places them where their receptive fields are
    centred (see `Encoder.cells`); None = the nominal centres (j + 0.5) / n.
    """
    (rows, cols), (width, height) = grid, image_size
    if cells is None:
        return (np.arange(cols) + 0.5) * (width / cols), (np.arange(rows) + 0.5) * (height / rows)
    return cells.centres(cols, width), cells.centres(rows, height)  # (W',), (H',)


def points_at(x: float, y: float, boxes: Iterable[BoxXYXY], tolerance: float) -> bool:
    """Is (x, y) inside one of `boxes`, or within `tolerance` pixels of one?"""
    for x0, y0, x1, y1 in boxes:
        if math.hypot(max(x0 - x, 0.0, x - x1), max(y0 - y, 0.0, y - y1)) <= tolerance:
            return True
    return False


def inside_mask(xs: np.ndarray, ys: np.ndarray, boxes: Iterable[BoxXYXY]) -> np.ndarray:
    """(H', W') bool: the cells whose centres lie inside one of `boxes` (x1/y1 exclusive)."""
    mask = np.zeros((len(ys), len(xs)), dtype=bool)
    for x0, y0, x1, y1 in boxes:
        mask |= np.outer((ys >= y0) & (ys < y1), (xs >= x0) & (xs < x1))  # (H', W')
    return mask


def covered_share(boxes: Sequence[BoxXYXY], image_size: tuple[int, int]) -> float:
    """The share of the photo the union of `boxes` covers (overlaps counted once)."""
    width, height = image_size
    xs = sorted({v for b in boxes for v in (b[0], b[2])})
    area = 0.0
    for left, right in zip(xs, xs[1:]):  # vertical strips between box edges
        spans = sorted((b[1], b[3]) for b in boxes if b[0] <= left and b[2] >= right)
        covered, top = 0.0, -math.inf
        for y0, y1 in spans:
            covered += max(0.0, y1 - max(y0, top))
            top = max(top, y1)
        area += (right - left) * covered
    return area / (width * height)


def look(word_map: np.ndarray, word: str, boxes: Sequence[BoxXYXY], image_size: tuple[int, int],
         cells: Cells | None = None) -> Look:
    """Score one word's (H', W') map against the boxes of the object(s) it names."""
    xs, ys = cell_centres(word_map.shape, image_size, cells)
    tolerance = TOLERANCE * max(image_size)
    r, c = np.unravel_index(int(np.argmax(word_map)), word_map.shape)
    inside = inside_mask(xs, ys, boxes)  # (H', W')
    width, height = image_size
    return Look(word, points_at(float(xs[c]), float(ys[r]), boxes, tolerance), float(word_map[inside].sum()),
                points_at(width / 2, height / 2, boxes, tolerance), float(inside.mean()),
                covered_share(boxes, image_size), (int(r), int(c)))


def caption_looks(sample: GroundingSample) -> list[tuple[tuple[int, ...], Look]]:
    """Each object word of a caption with the objects it names and its Look, in caption order."""
    attention = np.asarray(sample.attention, dtype=np.float64)  # (T, H', W')
    if attention.ndim != 3 or attention.shape[0] != len(sample.words):
        raise ValueError(f"grounding: attention of shape {attention.shape} for {len(sample.words)} words")
    looks = []
    for t, named in enumerate(word_objects(sample.words, sample.objects)):
        if named is not None:
            boxes = [b for j in named for b in sample.objects[j].boxes]
            looks.append((named, look(attention[t], sample.words[t], boxes, sample.image_size, sample.cells)))
    return looks


def pointing(looks: Sequence[Look]) -> Pointing:
    """Hit rate, mean mass and their baselines over `looks`."""
    if not looks:
        return Pointing(0, 0.0, 0.0, 0.0, 0.0)
    n = len(looks)
    return Pointing(n, sum(x.hit for x in looks) / n, math.fsum(x.mass for x in looks) / n,
                    sum(x.centre_hit for x in looks) / n, math.fsum(x.even_mass for x in looks) / n)


def grounding_score(samples: Iterable[GroundingSample]) -> GroundingResult:
    """The pointing game over every word of `samples` that names one of its photo's objects."""
    looks: list[Look] = []
    multi = own = 0
    distinct: list[float] = []
    for sample in samples:
        found = caption_looks(sample)
        looks += [x for _, x in found]
        if len(sample.words):
            peaks = np.asarray(sample.attention).reshape(len(sample.words), -1).argmax(axis=1)  # (T,)
            distinct.append(len(set(peaks.tolist())) / len(sample.words))
        first: dict[tuple[int, ...], Look] = {}
        for named, x in found:
            first.setdefault(named, x)
        if len(first) >= 2:
            multi += 1
            peaks_ = [x.peak for x in first.values()]
            own += all(x.hit for x in first.values()) and len(set(peaks_)) == len(peaks_)
    words: dict[str, list[Look]] = {}
    for x in looks:
        words.setdefault(x.word, []).append(x)
    by_word = {w: pointing(xs) for w, xs in sorted(words.items(), key=lambda kv: (-len(kv[1]), kv[0]))}
    return GroundingResult(pointing(looks), pointing([x for x in looks if x.share < SMALL]),
                           pointing([x for x in looks if x.share >= SMALL]), by_word, multi,
                           own / multi if multi else 0.0, float(np.mean(distinct)) if distinct else 0.0)
