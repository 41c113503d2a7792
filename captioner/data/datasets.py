"""Datasets over records: cached grids or images, with encoded captions; the pure `collate`, and
`pad_captions`, the one place captions are padded into a batch.

Inputs are either cached features, (L, D) float32 per image (from a `FeatureCache`), or images,
(3, S, S) through a transform (no cache, e.g. when the encoder is fine-tuned). The five captions
of an image share its one stored grid. `image_id` is the image's index in `dataset.records`. With a
second cache of mirrored grids (`data.mirror`), each time a batch reads a training image it reads one of
its two views at random (from the torch RNG, which `SeededItems` seeds), the captions of the mirrored
view with "left" and "right" swapped.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import Dataset

from captioner.data.cache import FeatureCache
from captioner.data.images import load_image
from captioner.data.mirror import mirror_ids
from captioner.data.records import Record
from captioner.data.vocab import Vocabulary

log = logging.getLogger(__name__)

Transform = Callable[[Image.Image], Tensor]  # PIL image -> (3, S, S)


class CaptionItem(NamedTuple):
    inputs: Tensor  # (L, D) float32 features, or (3, S, S) image
    tokens: Tensor  # (T_i,) int64: <start> w1..wn <end>
    image_id: int


class Batch(NamedTuple):
    inputs: Tensor  # (N, L, D) or (N, 3, S, S): each distinct image of the batch once
    tokens: Tensor  # (B, T) int64, padded with pad_id to the longest caption
    lengths: Tensor  # (B,) int64: scored positions per caption = words + <end> = T_i - 1
    image_ids: Tensor  # (B,) int64
    rows: Tensor  # (B,) int64: the row of `inputs` holding each caption's image


class ImageItem(NamedTuple):
    inputs: Tensor  # (L, D) or (3, S, S)
    image_id: int


class ImageBatch(NamedTuple):
    inputs: Tensor  # (B, L, D) or (B, 3, S, S)
    image_ids: Tensor  # (B,) int64


class _ImageInputs(Dataset):
    """Shared part: which records are usable and how an image becomes an input tensor."""

    def __init__(self, records: Sequence[Record], cache: FeatureCache | None, transform: Transform | None) -> None:
        if cache is None and transform is None:
            raise ValueError("give a feature cache or an image transform")
        self.cache, self.transform = cache, transform
        kept, rows, dropped = [], [], []
        for r in records:
            row = cache.row(r.image) if cache is not None else (0 if Path(r.image).is_file() else None)
            if row is None:
                dropped.append(r.image)
            else:
                kept.append(r)
                rows.append(row)
        self.records: list[Record] = kept
        self.dropped: list[Path] = dropped  # images not in the cache (skipped) or missing
        self._rows = rows
        if dropped:
            log.info("%d of %d images dropped (not in the feature cache or missing), e.g. %s",
                     len(dropped), len(records), dropped[0])

    @property
    def references(self) -> list[tuple[str, ...]]:
        """Raw captions of each image_id (for metrics)."""
        return [r.captions for r in self.records]

    def load_input(self, image_id: int) -> Tensor:
        """(L, D) float32 cached features, or (3, S, S) transformed image."""
        if self.cache is not None:
            return _features(self.cache, self._rows[image_id])
        return self.transform(load_image(self.records[image_id].image))  # type: ignore[misc]


def _features(cache: FeatureCache, row: int) -> Tensor:
    return torch.from_numpy(np.asarray(cache.get_row(row), dtype=np.float32))  # (L, D)


class CaptionDataset(_ImageInputs):
    """One item per (image, caption): `CaptionItem(inputs, tokens, image_id)`."""

    def __init__(self, records: Sequence[Record], vocab: Vocabulary, max_length: int = 20,
                 cache: FeatureCache | None = None, transform: Transform | None = None,
                 mirror: FeatureCache | None = None) -> None:
        """Args:
            records: images with captions; images not in `cache` (or missing files) are dropped.
            vocab: encodes captions as [<start>, w1..wn, <end>] with n <= max_length.
            cache: cached grids; when None, images are decoded and passed through `transform`.
            mirror: the grids of the mirrored photos (`captioner.data.mirror`), beside `cache`: an
                image is then read in either view with even odds (an image missing there, in its own).
        """
        super().__init__(records, cache, transform)
        if mirror is not None and cache is None:
            raise ValueError("mirrored grids come beside a feature cache")
        self.mirror = mirror
        self._mirror_rows = [mirror.row(r.image) for r in self.records] if mirror is not None else []
        self._mirror_ids = mirror_ids(vocab)  # (V,) word id -> its id in the mirror image's caption
        encoded = [(i, vocab.encode(c, max_length)) for i, r in enumerate(self.records) for c in r.captions]
        # one flat array + offsets: compact, and cheap to send to DataLoader workers
        self._image_of = np.array([i for i, _ in encoded], dtype=np.int64)
        self._offsets = np.cumsum([0] + [len(ids) for _, ids in encoded]).astype(np.int64)
        self._tokens = np.array([t for _, ids in encoded for t in ids], dtype=np.int64)

    def __len__(self) -> int:
        return len(self._image_of)

    @property
    def image_of(self) -> list[int]:
        """The image_id of every item, in item order (an image's captions are consecutive items)."""
        return self._image_of.tolist()

    @property
    def lengths(self) -> list[int]:
        """The length in tokens of every item's encoded caption (`<start>`, words, `<end>`), in item order."""
        return np.diff(self._offsets).tolist()

    def _tokens_of(self, i: int, mirrored: bool = False) -> Tensor:
        tokens = self._tokens[self._offsets[i]: self._offsets[i + 1]]  # (T_i,)
        return torch.from_numpy(self._mirror_ids[tokens] if mirrored else tokens.copy())

    def _view(self, image_id: int) -> tuple[Tensor, bool]:
        """The image's input in one of its views, and whether it is the mirrored one (one torch draw
        per call when there are mirrored grids, none otherwise)."""
        if self.mirror is not None and bool(torch.rand(()) < 0.5):
            row = self._mirror_rows[image_id]
            if row is not None:
                return _features(self.mirror, row), True
        return self.load_input(image_id), False

    def __getitem__(self, i: int) -> CaptionItem:
        image_id = int(self._image_of[i])
        inputs, mirrored = self._view(image_id)
        return CaptionItem(inputs, self._tokens_of(i, mirrored), image_id)

    def __getitems__(self, indices: Sequence[int]) -> list[CaptionItem]:
        """A batch's items, each distinct image read (or decoded and transformed) once and shared by
        its captions. The DataLoader calls this in place of `__getitem__` per index: an image's
        captions share a batch (`train.group_by_image`), so this reads ~5x fewer grids or JPEGs."""
        views: dict[int, tuple[Tensor, bool]] = {}  # image_id -> its input and whether it is mirrored
        items = []
        for i in indices:
            image_id = int(self._image_of[i])
            if image_id not in views:
                views[image_id] = self._view(image_id)
            inputs, mirrored = views[image_id]
            items.append(CaptionItem(inputs, self._tokens_of(i, mirrored), image_id))
        return items


class ImageDataset(_ImageInputs):
    """One item per image (for decoding / validation): `ImageItem(inputs, image_id)`."""

    def __init__(self, records: Sequence[Record], cache: FeatureCache | None = None,
                 transform: Transform | None = None) -> None:
        super().__init__(records, cache, transform)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, image_id: int) -> ImageItem:
        return ImageItem(self.load_input(image_id), image_id)


def pad_captions(captions: Sequence[Sequence[int] | Tensor], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Encoded captions (`<start> w1 .. wn <end>`, any lengths) -> tokens (B, T) int64, padded with
    `pad_id` to the longest, and lengths (B,) int64, the scored positions of each (words + <end>). Pure."""
    sizes = [len(c) for c in captions]
    tokens = torch.full((len(captions), max(sizes)), pad_id, dtype=torch.long)  # (B, T)
    for row, caption in enumerate(captions):
        tokens[row, : len(caption)] = torch.as_tensor(caption)
    return tokens, torch.tensor(sizes, dtype=torch.long) - 1  # (B, T), (B,)


def collate(batch: Sequence[CaptionItem], pad_id: int = 0) -> Batch:
    """Stack each distinct image's input once (captions of one image share it: the decoder projects
    it once) and pad captions to the longest in the batch. Pure."""
    first: dict[int, int] = {}  # image_id -> its row in inputs, in order of first appearance
    for row, it in enumerate(batch):
        first.setdefault(it.image_id, row)
    inputs = torch.stack([batch[row].inputs for row in first.values()])  # (N, L, D) or (N, 3, S, S)
    index = {image_id: n for n, image_id in enumerate(first)}
    rows = torch.tensor([index[it.image_id] for it in batch], dtype=torch.long)  # (B,)
    tokens, lengths = pad_captions([it.tokens for it in batch], pad_id)  # (B, T), (B,)
    image_ids = torch.tensor([it.image_id for it in batch], dtype=torch.long)  # (B,)
    return Batch(inputs, tokens, lengths, image_ids, rows)


def collate_images(batch: Sequence[ImageItem]) -> ImageBatch:
    """Stack the inputs of an image batch. Pure."""
    inputs = torch.stack([it.inputs for it in batch])  # (B, L, D) or (B, 3, S, S)
    return ImageBatch(inputs, torch.tensor([it.image_id for it in batch], dtype=torch.long))
