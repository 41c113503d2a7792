"""`captioner prepare`: the feature cache of a data set ahead of training, with a summary (images,
captions, vocabulary size, what could not be read)."""
from __future__ import annotations

import argparse
import dataclasses
import sys

from captioner.cli.common import add_device, add_encoder_weights, add_overrides, overrides
from captioner.errors import CaptionerError


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="check a data set and fill its feature cache ahead of training")
    add_device(p)
    p.add_argument("--data", help="folder or caption file (layout detected), or 'shapes'; default: data.path")
    p.add_argument("--config", help="YAML config or a shipped config's name (data and model.encoder are used)")
    p.add_argument("--image-root", help="folder holding the images, when not next to the caption file")
    p.add_argument("--batch-size", type=int, default=32, help="images per encoder batch")
    add_encoder_weights(p)
    add_overrides(p, "data.min_word_count=5")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from captioner.config import load_config
    from captioner.recipes.prepare import prepare
    from captioner.device import resolve_device

    if args.batch_size < 1:
        raise CaptionerError(f"--batch-size: {args.batch_size} images per encoder batch; give 1 or more")
    cfg = load_config(args.config, overrides(args))
    data = dataclasses.replace(cfg.data, path=args.data) if args.data else cfg.data
    s = prepare(data, cfg.model.encoder, device=resolve_device(args.device), image_root=args.image_root,
                batch_size=args.batch_size, progress=sys.stderr.isatty())
    print(f"data:        {s.data}")
    for split in s.images:
        if s.images[split]:
            print(f"  {split:<6} {s.images[split]:>7,} images {s.captions[split]:>9,} captions")
    print(f"  total  {sum(s.images.values()):>7,} images {sum(s.captions.values()):>9,} captions")
    if s.skipped:
        print(f"skipped:     {len(s.skipped)} images")
        for path, reason in s.skipped[:20]:
            print(f"  {path}: {reason}")
        if len(s.skipped) > 20:
            print(f"  ... and {len(s.skipped) - 20} more")
    print(f"vocabulary:  {s.vocab_size:,} words (min count {data.min_word_count}), as `captioner train` counts them")
    if s.cache_path is not None:
        print(f"cache:       {s.cache_mb:,.1f} MB ({s.built} encoded now, {s.reused} reused) -> {s.cache_path}")
    for note in s.notes:
        print(f"note:        {note}")
    return 0
