"""Data: caption sources -> records -> vocabulary -> images or cached grids -> batches.

    sources.py   `load_records(data_cfg)`: the entry point (layout detection, the shapes set)
    readers.py   one reader per caption-file layout (COCO, Karpathy, Flickr8k csv / token)
    records.py   `Record`, `Box`, splitting by image
    shapes.py    the built-in shapes set (drawn images, true captions, object boxes)
    vocab.py     tokenisation and the word <-> id vocabulary
    images.py    image files -> RGB PIL images (EXIF, modes), one-line errors
    cache.py     the on-disk feature cache of a frozen encoder's grids
    datasets.py  caption / image datasets and `collate`
    order.py     the seeded, resumable training order (an image's captions together)
"""
from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {  # name -> its module
    "Batch": "captioner.data.datasets",
    "CaptionDataset": "captioner.data.datasets",
    "ImageDataset": "captioner.data.datasets",
    "collate": "captioner.data.datasets",
    "collate_images": "captioner.data.datasets",
    "ImageError": "captioner.data.images",
    "load_image": "captioner.data.images",
    "SPLITS": "captioner.data.records",
    "Box": "captioner.data.records",
    "Record": "captioner.data.records",
    "SourceError": "captioner.data.records",
    "split_records": "captioner.data.records",
    "load_records": "captioner.data.sources",
    "read_source": "captioner.data.sources",
    "Vocabulary": "captioner.data.vocab",
    "build_vocabulary": "captioner.data.vocab",
    "tokenize": "captioner.data.vocab",
}
__all__ = ["SPLITS", "Batch", "Box", "CaptionDataset", "ImageDataset", "ImageError", "Record", "SourceError",
           "Vocabulary", "build_vocabulary", "collate", "collate_images", "load_image", "load_records",
           "read_source", "split_records", "tokenize"]


def __getattr__(name: str) -> Any:
    """A public name, imported on first use, so that importing one light module of the package
    (`captioner.data.images`) does not import the rest of it, torch included."""
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
