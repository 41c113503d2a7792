"""`captioner prepare`, the recipe: records -> vocabulary size (train split) -> feature cache (all splits).

`prepare(...)` does the work and returns a `PrepareSummary`; the CLI prints it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from captioner.config import DataConfig, EncoderConfig
from captioner.data.cache import cache_dir_of
from captioner.data.cache_build import build_cache
from captioner.data.mirror import Mirrored
from captioner.data.records import SPLITS, SourceError
from captioner.data.sources import load_records
from captioner.data.vocab import build_vocabulary
from captioner.deploy.cache_encoder import cache_encoder
from captioner.errors import CaptionerError
from captioner.model.encoder import build_encoder

log = logging.getLogger(__name__)

@dataclass
class PrepareSummary:
    data: str
    images: dict[str, int]  # usable images per split
    captions: dict[str, int]  # captions of usable images per split
    skipped: list[tuple[Path, str]]  # images that could not be used, with the reason
    vocab_size: int  # the words `captioner train` will count on the same settings
    cache_path: Path | None = None  # None when the cache is not used (fine-tuned encoder, use_cache off)
    cache_mb: float = 0.0
    built: int = 0  # images encoded now
    reused: int = 0  # images already in the cache
    notes: list[str] = field(default_factory=list)


def prepare(data: DataConfig, encoder_cfg: EncoderConfig, device: str | torch.device = "cpu",
            image_root: str | Path | None = None, batch_size: int = 32, progress: bool = True) -> PrepareSummary:
    """Load records, count the vocabulary of the train split (as `captioner train` will) and, with a
    frozen encoder and `data.use_cache`, fill the feature cache for every split (in `data.cache_dir`,
    default `$CAPTIONER_CACHE/features`, where `captioner train` finds it), and with `data.mirror` that of
    the mirrored training photos. Raises CaptionerError for
    bad input."""
    records = load_records(data, image_root)
    train_captions = [c for r in records if r.split == "train" for c in r.captions]
    if not train_captions:
        raise SourceError(f"{data.path}: no training captions (the train split is empty)")
    vocab = build_vocabulary(train_captions, data.min_word_count, data.max_length)
    summary = PrepareSummary(data=str(data.path), images={}, captions={}, skipped=[], vocab_size=len(vocab))
    usable = records
    if not data.use_cache:
        summary.notes.append("feature cache off (data.use_cache=false)")
    elif encoder_cfg.trainable_stages > 0:
        summary.notes.append("feature cache not used: the encoder is fine-tuned (model.encoder.trainable_stages > 0)")
    else:
        encoder = cache_encoder(build_encoder(encoder_cfg, pretrained=True), device, data.cache_runtime)
        fill = partial(build_cache, cache_dir=cache_dir_of(data), batch_size=batch_size, device=device,
                       num_workers=data.num_workers, progress=progress)
        result = fill(records, encoder)
        if data.mirror:  # the training photos flipped, as `captioner train` reads them
            mirror = fill([r for r in records if r.split == "train"], Mirrored(encoder))
            summary.notes.append(f"mirrored training photos: {mirror.cache.folder} "
                                 f"({mirror.cache.nbytes / 2**20:.1f} MB, {mirror.built} encoded now)")
        bad = {p for p, _ in result.skipped}
        usable = [r for r in records if r.image not in bad]
        summary.skipped = result.skipped
        summary.cache_path = result.cache.folder
        summary.cache_mb = result.cache.nbytes / 2**20
        summary.built, summary.reused = result.built, result.reused
    if not usable:
        raise CaptionerError(f"{data.path}: none of the {len(records)} images could be read "
                             f"(first: {summary.skipped[0][0]}: {summary.skipped[0][1]})")
    for split in SPLITS:
        recs = [r for r in usable if r.split == split]
        summary.images[split] = len(recs)
        summary.captions[split] = sum(len(r.captions) for r in recs)
    return summary
