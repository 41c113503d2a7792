"""Training throughput: the decoder from the feature cache vs. the frozen encoder run on every batch.

    python scripts/bench_train.py                       # one epoch of flickr8k-800 each way
    python scripts/bench_train.py --limit-images 200    # quicker: the first 200 training images

Both ways train the same model (same initial weights, batch size) for one epoch:
  (a) cached:   the decoder trains from each image's stored grid (computed once, then read from disk row by row),
                in captioner's training order: an image's captions share a batch, so its grid is
                projected once for all of them (`train.group_by_image`);
  (b) encoder:  every caption's JPEG is decoded, resized and run through the frozen encoder, in a
                plain shuffled caption order, as most implementations do; then the same decoder step.
A third row, (a) in (b)'s plain caption order, shows what the grouping contributes; a fourth, (a)
with batches of similar caption lengths (`train.group_by_length`), what that saves (with the decoder
steps a batch runs either way: its longest caption's scored tokens); with a word detector
(`model.decoder.concepts`), a fifth, (a) with the detector scoring every word of the vocabulary at
every step instead of the batch's words and `train.concept_negatives` others.
Printed: captions/s of each and the ratio (a)/(b), tokens/s, peak RSS, the achieved GFLOP/s of (a)
(FLOPs counted with FlopCounterMode over its first batches: matmuls, convolutions) next to this
machine's matmul peak. (Float32 against bf16 autocast: scripts/bench_amp.py, on whole training runs.)
The one-time cache build is timed separately.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import logging
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from captioner.config import TrainConfig, load_config
from captioner.data.cache_build import build_cache
from captioner.data.datasets import CaptionDataset, collate
from captioner.data.order import EpochBatchSampler
from captioner.data.records import split_records
from captioner.data.sources import load_records
from captioner.data.vocab import build_vocabulary
from captioner.model import build_model
from captioner.device import autocast_dtype
from captioner.training.loop import train_one_epoch
from captioner.training.loss import Criterion, build_criterion
from captioner.training.objective import CrossEntropy
from captioner.training.optim import build_optimizer
from captioner.training.state import Meter

ROOT = Path(__file__).resolve().parents[1]


def matmul_peak(n: int = 2048, reps: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """GFLOP/s of a large torch.matmul on this machine (best of `reps`)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(reps):
        tick = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - tick)
    return 2 * n**3 / best / 1e9


def one_epoch(model, loader, tc: TrainConfig, vocab, cached: bool, amp_dtype: torch.dtype | None = None,
              encoder: str = "") -> Meter:
    """Train a copy of `model` for one pass over `loader` with the optimiser and loss `captioner
    train` builds from `tc`; the meter holds captions, tokens, seconds."""
    model = copy.deepcopy(model)
    net = model.decoder if cached else model
    optimizer = build_optimizer(model, tc)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    objective = CrossEntropy(net, tc, build_criterion(tc, vocab, encoder), torch.device("cpu"), amp_dtype)
    meter = Meter()
    torch.manual_seed(0)
    train_one_epoch(objective, loader, optimizer, scheduler, scaler, meter, grad_clip=tc.grad_clip,
                    progress=sys.stderr.isatty(), desc="cached" if cached else "encoder")
    return meter


def mean_steps(sampler: EpochBatchSampler, dataset: CaptionDataset) -> float:
    """Decoder steps per batch of one epoch of `sampler`: its longest caption's scored tokens."""
    lengths = dataset.lengths
    batches = list(sampler)
    return sum(max(lengths[i] for i in b) - 1 for b in batches) / len(batches)


def flops_per_caption(model, loader, criterion: Criterion, batches: int = 20) -> float:
    """FLOPs (matmul/conv) per caption of cached training steps (decoder forward and backward),
    counted over the loader's first `batches` batches."""
    decoder = copy.deepcopy(model.decoder)
    captions = 0
    with FlopCounterMode(display=False) as counter:
        for batch in itertools.islice(loader, batches):
            out = decoder(batch.inputs, batch.tokens, batch.lengths, batch.rows,
                          detect=criterion.detector_outputs(batch.tokens))
            criterion(out, batch.tokens).total.backward()
            captions += len(batch.lengths)
    return counter.get_total_flops() / captions


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "flickr8k-800.yaml"))
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "flickr8k-800"))
    p.add_argument("--limit-images", type=int, default=0, help="use only the first N training images (0 = all)")
    p.add_argument("--batch-size", type=int, default=0, help="default: the config's train.batch_size")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers for both ways")
    p.add_argument("--cache-dir", default="", help="feature cache folder (default: a temporary one)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = load_config(args.config, [f"data.path={args.data}", *args.overrides])
    batch_size = args.batch_size or cfg.train.batch_size
    amp_dtype = autocast_dtype(cfg.train.amp, torch.device("cpu"))
    train_records = split_records(load_records(cfg.data))["train"]
    if args.limit_images:
        train_records = train_records[: args.limit_images]
    vocab = build_vocabulary([c for r in train_records for c in r.captions], cfg.data.min_word_count)
    torch.manual_seed(0)
    model = build_model(cfg.model, len(vocab))
    enc = cfg.model.encoder
    grid = model.encoder.grid
    print(f"data: {len(train_records)} training images of {args.data}; {enc.name} at {enc.image_size} px "
          f"(grid {grid[0]}x{grid[1]}, D {model.encoder.out_dim}); vocabulary {len(vocab)}; batch {batch_size}; "
          f"autocast {amp_dtype or 'off (float32)'}; "
          f"{torch.get_num_threads()} threads")

    with tempfile.TemporaryDirectory() as tmp:
        tick = time.perf_counter()
        cache = build_cache(train_records, model.encoder, args.cache_dir or tmp, batch_size=batch_size,
                            progress=sys.stderr.isatty()).cache
        build_s = time.perf_counter() - tick
        print(f"cache build (once): {len(train_records) / build_s:.1f} images/s, {cache.nbytes / 2**20:.0f} MB")

        def loader(dataset, grouped: bool, by_length: bool = False) -> DataLoader:
            groups = dataset.image_of if grouped else None
            lengths = dataset.lengths if by_length else None
            sampler = EpochBatchSampler(len(dataset), batch_size, seed=0, groups=groups, lengths=lengths)
            return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=args.workers,
                              generator=torch.Generator().manual_seed(0))

        cached_set = CaptionDataset(train_records, vocab, cfg.data.max_length, cache=cache)
        image_set = CaptionDataset(train_records, vocab, cfg.data.max_length,
                                   transform=model.encoder.transform(train=False))

        def epoch(loader_, tc_: TrainConfig = cfg.train, cached: bool = True) -> Meter:
            return one_epoch(model, loader_, tc_, vocab, cached, amp_dtype, enc.name)

        tc = cfg.train
        a = epoch(loader(cached_set, tc.group_by_image))
        a_plain = epoch(loader(cached_set, False))
        a_length = epoch(loader(cached_set, tc.group_by_image, True))
        steps = {by_length: mean_steps(loader(cached_set, tc.group_by_image, by_length).batch_sampler, cached_set)
                 for by_length in (False, True)}
        a_all = None
        if cfg.model.decoder.concepts:
            a_all = epoch(loader(cached_set, tc.group_by_image), dataclasses.replace(tc, concept_negatives=-1))
        b = epoch(loader(image_set, False), cached=False)
        flops = flops_per_caption(model, loader(cached_set, tc.group_by_image),
                                  build_criterion(tc, vocab, enc.name)) * a.captions

    peak = matmul_peak()
    peak_bf16 = matmul_peak(dtype=torch.bfloat16) if amp_dtype == torch.bfloat16 else None
    rate_a, rate_a_plain, rate_b = (m.captions / m.seconds for m in (a, a_plain, b))
    achieved = flops / a.seconds / 1e9
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows = [("(a) cached, grouped by image", a), ("(a) cached, plain caption order", a_plain),
            ("(a) grouped, similar lengths", a_length),
            *([("(a) detector scoring all words", a_all)] if a_all is not None else []),
            ("(b) encoder on every caption", b)]
    print(f"{'way':34s} {'captions':>8s} {'seconds':>8s} {'captions/s':>11s} {'tokens/s':>9s}")
    for name, m in rows:
        print(f"{name:34s} {m.captions:8d} {m.seconds:8.1f} {m.captions / m.seconds:11,.1f} "
              f"{m.tokens / m.seconds:9,.0f}")
    print(f"speed-up (a)/(b): {rate_a / rate_b:.1f}x   (grouping alone: {rate_a / rate_a_plain:.2f}x"
          + f"; similar lengths: {a_length.captions / a_length.seconds / rate_a:.2f}x, decoder steps per batch "
            f"{steps[False]:.1f} -> {steps[True]:.1f}"
          + (f"; the detector on the batch's words + {tc.concept_negatives} others instead of all "
             f"{len(vocab)}: {rate_a / (a_all.captions / a_all.seconds):.2f}x" if a_all is not None else "") + ")")
    print(f"(a) achieved: {achieved:.1f} GFLOP/s ({flops / a.captions / 1e6:.0f} MFLOP per caption, fwd+bwd, "
          f"matmuls only) vs fp32 matmul peak {peak:.1f} GFLOP/s ({100 * achieved / peak:.0f}%)"
          + (f", bf16 matmul peak {peak_bf16:.1f} GFLOP/s ({100 * achieved / peak_bf16:.0f}%)" if peak_bf16 else ""))
    print(f"peak RSS: {rss_mb:,.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
