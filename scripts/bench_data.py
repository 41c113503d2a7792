"""Benchmark the data path: building the feature cache, then reading captions from the cache vs
decoding JPEGs (+ the encoder's eval transform), both through CaptionDataset + DataLoader + collate.

    python scripts/bench_data.py [--data /work/shared/data/flickr8k-800] [--encoder efficientnet_lite0]

The cache is built in a fresh temporary folder (deleted afterwards), so the build is always cold.
"""
from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from captioner.config import EncoderConfig
from captioner.data.cache_build import build_cache
from captioner.data.datasets import CaptionDataset, collate
from captioner.data.sources import read_source as load_records
from captioner.data.vocab import build_vocabulary
from captioner.model.encoder import build_encoder
from captioner.device import resolve_device

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared/data/flickr8k-800"


def _read_all(dataset: CaptionDataset, batch_size: int, num_workers: int) -> tuple[int, float]:
    """Iterate one shuffled epoch; returns (captions, seconds)."""
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=num_workers, collate_fn=collate)
    start = time.perf_counter()
    n = sum(len(batch.image_ids) for batch in loader)
    return n, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(DEFAULT_DATA))
    p.add_argument("--encoder", default=EncoderConfig.name)
    p.add_argument("--image-size", type=int, default=EncoderConfig.image_size)
    p.add_argument("--batch-size", type=int, default=64, help="captions per batch when reading")
    p.add_argument("--cache-batch-size", type=int, default=32, help="images per encoder batch when building")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)

    records = load_records(args.data)
    vocab = build_vocabulary(c for r in records for c in r.captions)
    encoder = build_encoder(EncoderConfig(name=args.encoder, image_size=args.image_size))
    device = resolve_device(args.device)
    print(f"data {args.data}: {len(records)} images, {sum(len(r.captions) for r in records)} captions; "
          f"encoder {encoder.cache_key()} grid {encoder.grid} D={encoder.out_dim}; device {device}; "
          f"{torch.get_num_threads()} threads, {args.num_workers} workers")

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        result = build_cache(records, encoder, tmp, batch_size=args.cache_batch_size, device=device,
                             num_workers=args.num_workers, progress=False)
        build_s = time.perf_counter() - start
        cached = CaptionDataset(records, vocab, cache=result.cache)
        n_cache, cache_s = _read_all(cached, args.batch_size, args.num_workers)
        jpeg = CaptionDataset(records, vocab, transform=encoder.transform(train=False))
        n_jpeg, jpeg_s = _read_all(jpeg, args.batch_size, args.num_workers)
        mb = result.cache.nbytes / 2**20

    rows = [
        ("build cache (decode + encode)", f"{result.built} images", build_s, result.built / build_s, "images/s"),
        ("read captions from cache", f"{n_cache} captions", cache_s, n_cache / cache_s, "captions/s"),
        ("read captions from JPEGs", f"{n_jpeg} captions", jpeg_s, n_jpeg / jpeg_s, "captions/s"),
    ]
    print(f"\n{'step':<32}{'items':>16}{'seconds':>10}{'rate':>12}  unit")
    for name, items, secs, rate, unit in rows:
        print(f"{name:<32}{items:>16}{secs:>10.2f}{rate:>12.1f}  {unit}")
    print(f"\ncache {mb:.1f} MB on disk ({len(result.skipped)} images skipped); "
          f"cache / JPEG read speed = {(n_cache / cache_s) / (n_jpeg / jpeg_s):.1f}x")


if __name__ == "__main__":
    main()
