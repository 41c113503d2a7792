"""What a data set is once read: `Record`s (an image, its captions, its split, optional object
boxes) and the pure functions that split them by image."""
from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from captioner.errors import CaptionerError

SPLITS: tuple[str, ...] = ("train", "val", "test")


class SourceError(CaptionerError):
    """A caption source that cannot be read: "FILE:LINE: reason", "FILE: key 'x': reason", ..."""


@dataclass(frozen=True)
class Box:
    """An object's box in pixels of the original image (x to the right, y down, x0 < x1, y0 < y1)."""

    label: str
    x0: float
    y0: float
    x1: float
    y1: float


@dataclass(frozen=True)
class Record:
    """One image, its captions, its split ("train" | "val" | "test") and optional object boxes."""

    image: Path
    captions: tuple[str, ...]
    split: str
    boxes: tuple[Box, ...] = ()

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"{self.image}: split {self.split!r} is not one of {', '.join(SPLITS)}")


def fingerprint(records: Iterable[Record]) -> dict[str, int | str]:
    """What identifies a set of records for resuming: image and caption counts and a digest of
    every image's file name and captions (names, not paths: the data may move)."""
    entries = sorted((Path(r.image).name, r.captions) for r in records)
    digest = hashlib.sha1(repr(entries).encode()).hexdigest()[:16]
    return {"images": len(entries), "captions": sum(len(c) for _, c in entries), "digest": digest}


def split_records(records: Iterable[Record]) -> dict[str, list[Record]]:
    """Records grouped by split (every split present as a key, maybe empty)."""
    out: dict[str, list[Record]] = {s: [] for s in SPLITS}
    for r in records:
        out[r.split].append(r)
    return out


def assign_splits(records: list[Record], val_fraction: float, test_fraction: float = 0.0, seed: int = 0,
                  val_fold: int = 0) -> list[Record]:
    """Split BY IMAGE with a fixed seed: round(n*fraction) images (at least 1 when the fraction > 0)
    go to val and test, the rest to train. Independent of the input order. Pure.

    `val_fold` k takes the k-th block of n_val images of the shuffled order for validation (0 = the
    first): folds 0..n//n_val - 1 of one seed hold disjoint validation images (k-fold validation)."""
    n = len(records)
    order = sorted(range(n), key=lambda i: str(records[i].image))
    random.Random(seed).shuffle(order)
    n_val, n_test = (0 if f == 0 else max(1, round(n * f)) for f in (val_fraction, test_fraction))
    if n_val + n_test >= n:
        raise SourceError(f"{n} images are too few for val_fraction={val_fraction}, test_fraction={test_fraction}")
    if val_fold and (n_val == 0 or (val_fold + 1) * n_val > n):
        raise SourceError(f"data.val_fold {val_fold}: {n} images hold {n // n_val if n_val else 0} folds of "
                          f"{n_val} validation images (val_fold 0..{n // n_val - 1 if n_val else 0})")
    order = order[val_fold * n_val :] + order[: val_fold * n_val]  # fold k first
    split = [""] * n
    for rank, i in enumerate(order):
        split[i] = "val" if rank < n_val else "test" if rank < n_val + n_test else "train"
    return [replace(r, split=s) for r, s in zip(records, split)]

