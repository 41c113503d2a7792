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
from captioner.data.datasets import Batch, CaptionDataset, ImageDataset, collate, collate_images
from captioner.data.images import ImageError, load_image
from captioner.data.records import SPLITS, Box, Record, SourceError, split_records
from captioner.data.sources import load_records, read_source
from captioner.data.vocab import Vocabulary, build_vocabulary, tokenize

__all__ = ["SPLITS", "Batch", "Box", "CaptionDataset", "ImageDataset", "ImageError", "Record", "SourceError",
           "Vocabulary", "build_vocabulary", "collate", "collate_images", "load_image", "load_records",
           "read_source", "split_records", "tokenize"]
