"""Captioning throughput: beam search batched (32 images a batch) against one image at a time.

    python scripts/bench_decode.py [--checkpoint CKPT] [--data /work/shared/data/flickr8k-800]
                                   [--images 64] [--beam 5] [--batch-size 32] [--device auto]

Same model, same images, in one run. Images are decoded from disk once, before timing; the
throughput rows time preprocessing + encoder + search ("end to end") and the search alone (on
precomputed features). The latency row times one image from its file: load + encode + decode.
Without --checkpoint an UNTRAINED model is built (the default encoder with its ImageNet weights, a
random decoder, a vocabulary from the data's captions); its captions are nonsense but the amount
of work per step is that of a real model. It runs to max_length more often than a trained model,
so its numbers are a worst case.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from captioner.config import DecodeConfig, ModelConfig
from captioner.data.images import load_image
from captioner.data.sources import read_source
from captioner.data.vocab import build_vocabulary
from captioner.decoding.captioner import Captioner
from captioner.decoding.search import decode
from captioner.model import build_model
from captioner.runtime import resolve_device, seed_everything


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="a trained checkpoint; default: an untrained model (see above)")
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/flickr8k-800"), help="data set whose images are captioned")
    p.add_argument("--images", type=int, default=64, help="images per measurement")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--max-length", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each measurement; the best counts")
    return p


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def build_captioner(args, records, device: torch.device) -> tuple[Captioner, str]:
    decode_cfg = DecodeConfig(beam_size=args.beam, max_length=args.max_length)
    if args.checkpoint:
        return Captioner.from_checkpoint(args.checkpoint, device, decode_cfg), f"checkpoint {args.checkpoint}"
    vocab = build_vocabulary(c for r in records for c in r.captions)
    cfg = ModelConfig()
    model = build_model(cfg, len(vocab), pretrained=True)
    what = (f"UNTRAINED model: {cfg.encoder.name} encoder (ImageNet weights) at {cfg.encoder.image_size} px, "
            f"random decoder (H={cfg.decoder.hidden_dim}), vocabulary of {len(vocab)} words from {args.data}")
    return Captioner(model, vocab, decode_cfg, device), what


def main(args) -> None:
    seed_everything(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    records = read_source(args.data)
    paths = [r.image for r in records][: args.images]
    captioner, what = build_captioner(args, records, device)
    images = [load_image(p) for p in paths]
    n, bs = len(images), args.batch_size
    print(f"model:   {what}")
    print(f"device:  {device} ({torch.get_num_threads()} CPU threads); {n} images from {args.data}")
    print(f"decode:  beam {args.beam}, max length {args.max_length}, batch {bs} vs 1; best of {args.repeats} runs")

    captioner.caption(images[:2], batch_size=2)  # warm-up (allocators, lazy init)
    with torch.inference_mode():
        features = torch.cat([captioner.encode(images[i : i + bs]) for i in range(0, n, bs)])  # (N, L, D)
    dec, vocab, cfg = captioner.model.decoder, captioner.vocab, captioner.decode
    lengths = [len(h.tokens) for i in range(0, n, bs) for h in decode(dec, features[i : i + bs], cfg, vocab)]

    def search(size: int) -> None:
        with torch.inference_mode():
            for i in range(0, n, size):
                decode(dec, features[i : i + size], cfg, vocab)

    runs = {  # name -> (batch 1, batch bs) workloads; end to end, then the two halves apart
        "end to end (images/s)": (lambda: [captioner.caption([im], batch_size=1) for im in images],
                                  lambda: captioner.caption(images, batch_size=bs)),
        "preprocess + encoder (images/s)": (lambda: [captioner.encode(images[i : i + 1]) for i in range(n)],
                                            lambda: [captioner.encode(images[i : i + bs]) for i in range(0, n, bs)]),
        "beam search only (images/s)": (lambda: search(1), lambda: search(bs)),
    }
    # Interleaved repeats, best of each: other processes on a shared machine only ever add time.
    best = {name: [float("inf"), float("inf")] for name in runs}
    for _ in range(args.repeats):
        for name, fns in runs.items():
            for j, fn in enumerate(fns):
                best[name][j] = min(best[name][j], _timed(fn, device))
    latencies = [_timed(lambda p=p: captioner.caption([load_image(p)], batch_size=1), device) for p in paths[:10]]

    print(f"captions: mean {statistics.mean(lengths):.1f} words, {sum(x == args.max_length for x in lengths)} of "
          f"{n} cut at max length")
    print()
    print(f"{'measurement':<34}{'batch 1':>12}{f'batch {bs}':>12}{'ratio':>8}")
    for name, (single, batched) in best.items():
        print(f"{name:<34}{n / single:>12.1f}{n / batched:>12.1f}{single / batched:>7.1f}x")
    print(f"{'latency, 1 image from file (ms)':<34}{1000 * statistics.median(latencies):>12.1f}"
          f"{'':>12}{'':>8}  (median of {len(latencies)}; load + encode + decode)")


if __name__ == "__main__":
    main(get_args_parser().parse_args())
