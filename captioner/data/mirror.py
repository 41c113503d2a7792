"""Mirror images for training from the feature cache (`data.mirror`): each photo also seen flipped
left to right, its captions with "left" and "right" swapped.

A frozen encoder's grids are computed once, so the only augmentation the cache can hold is a second,
fixed view of every photo. `Mirrored(encoder)` is the encoder that sees that view: it flips each photo
before the encoder's own preprocessing and has a cache key of its own, so `build_cache` stores the
mirrored grids in a folder beside the photos' own. `mirror_ids(vocab)` maps a caption's word ids to
those of its mirror image.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from PIL import Image, ImageOps
from torch import Tensor

from captioner.data.vocab import Vocabulary

MIRROR_WORDS = {"left": "right", "right": "left"}  # what a caption says that a mirror changes


def mirror_ids(vocab: Vocabulary) -> np.ndarray:
    """(V,) int64: the id of each word in the mirror image's caption (`ids[tokens]` swaps "left" and
    "right"; every other word, and a side word the vocabulary lacks, maps to itself)."""
    ids = np.arange(len(vocab), dtype=np.int64)
    for word, other in MIRROR_WORDS.items():
        if word in vocab and other in vocab:
            ids[vocab.id(word)] = vocab.id(other)
    return ids


def _mirrored(transform: Callable[[Image.Image], Tensor], image: Image.Image) -> Tensor:
    return transform(ImageOps.mirror(image))


class Mirrored:
    """A frozen grid encoder (`captioner.data.cache_build.GridEncoder`) that sees every photo flipped
    left to right; every other attribute is the encoder's."""

    def __init__(self, encoder: Any) -> None:
        self.encoder = encoder

    def __getattr__(self, name: str) -> Any:
        return getattr(self.encoder, name)

    def transform(self, train: bool = False) -> Callable[[Image.Image], Tensor]:
        """PIL image -> (3, S, S): the encoder's preprocessing of the mirrored photo (picklable, for loader workers)."""
        return partial(_mirrored, self.encoder.transform(train))

    def cache_key(self) -> str:
        return f"{self.encoder.cache_key()}-mirror"
