"""The cross-entropy training step with and without its exact shortcut on a two-scale grid, side by side.

    python scripts/bench_step.py                                   # the Flickr8k recipe's step
    python scripts/bench_step.py --data ../shared/data/flickr8k-800 --repeats 5

On a two-scale grid (`model.encoder.two_scale`) the last stage's channels are the same in the four cells
of each 2x2 block; the projection and the word detector multiply them once per block
(`captioner.model.regions`), the same numbers as multiplying them in every cell (tests/test_decoder.py).
This measures what that saves on this machine. The same batches (the first training photos' captions,
grouped by photo as `captioner train` groups them, the vocabulary of the whole training split), the same
initial weights and optimiser each way; the two ways take turns on every batch (this machine's speed
drifts by the minute: turns of whole runs measured the drift), over `--steps` batches after 3 warm-up
ones, `--repeats` times. Printed: ms per step and the per-cell step's time over the shipped one's, in
all and per repeat.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from captioner.config import load_config
from captioner.data.cache_build import build_cache
from captioner.data.datasets import CaptionDataset, collate
from captioner.data.order import EpochBatchSampler
from captioner.data.records import split_records
from captioner.data.sources import load_records
from captioner.data.vocab import build_vocabulary
from captioner.device import autocast_dtype
from captioner.model import build_model
from captioner.model.regions import RegionLinear
from captioner.training.loss import build_criterion
from captioner.training.objective import CrossEntropy
from captioner.training.optim import build_optimizer

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 3


@contextlib.contextmanager
def shared_channels_in_every_cell(decoder: torch.nn.Module) -> Iterator[None]:
    """The projection and the detector multiply every cell's copy of the shared channels."""
    layers = [m for m in decoder.modules() if isinstance(m, RegionLinear)]
    kept = [m.block_dim for m in layers]
    for m in layers:
        m.block_dim = 0
    try:
        yield
    finally:
        for m, block_dim in zip(layers, kept):
            m.block_dim = block_dim


WAYS = {"the step as shipped": lambda decoder: contextlib.nullcontext(),
        "shared channels in every cell": shared_channels_in_every_cell}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="flickr8k", help="a config with a two-scale grid (default: flickr8k)")
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "flickr8k"))
    p.add_argument("--images", type=int, default=200, help="training photos whose captions make the batches")
    p.add_argument("--steps", type=int, default=25, help="timed batches per repeat")
    p.add_argument("--repeats", type=int, default=3, help="passes over the batches")
    p.add_argument("--cache-dir", default="", help="feature cache folder (default: a temporary one)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = p.parse_args(argv)

    cfg = load_config(args.config, [f"data.path={args.data}", *args.overrides])
    train = split_records(load_records(cfg.data))["train"]
    vocab = build_vocabulary([c for r in train for c in r.captions], cfg.data.min_word_count)
    torch.manual_seed(0)
    model = build_model(cfg.model, len(vocab))
    amp_dtype = autocast_dtype(cfg.train.amp, torch.device("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        cache = build_cache(train[: args.images], model.encoder, args.cache_dir or tmp, progress=False).cache
        dataset = CaptionDataset(train[: args.images], vocab, cfg.data.max_length, cache=cache)
        sampler = EpochBatchSampler(len(dataset), cfg.train.batch_size, seed=0, groups=dataset.image_of)
        loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)
        epoch = list(itertools.islice(loader, WARMUP + args.steps))
        batches = list(itertools.islice(itertools.cycle(epoch), WARMUP + args.steps))  # a small set's batches again
    print(f"{cfg.model.encoder.name} grid {model.encoder.grid[0]}x{model.encoder.grid[1]} "
          f"(D {model.encoder.out_dim}, {model.encoder.block_dim} shared per 2x2 block); vocabulary {len(vocab)}; "
          f"{len(epoch)} batches of {cfg.train.batch_size} captions; autocast {amp_dtype or 'off (float32)'}; "
          f"{torch.get_num_threads()} threads")
    criterion = build_criterion(cfg.train, vocab, cfg.model.encoder.name)
    runs = {}
    if not model.encoder.block_dim:
        raise SystemExit(f"{args.config}: the encoder's grid is not two-scale (model.encoder.two_scale=true)")
    for name, undo in WAYS.items():
        copied = copy.deepcopy(model)  # each way its own weights and optimiser state, all from the same start
        decoder = copied.decoder.train()
        objective = CrossEntropy(decoder, cfg.train, criterion, torch.device("cpu"), amp_dtype)
        runs[name] = (objective, build_optimizer(copied, cfg.train), undo, decoder)
    seconds = {name: [0.0] * args.repeats for name in runs}
    names = list(runs)
    for repeat, (i, batch) in itertools.product(range(args.repeats), enumerate(batches)):
        for k in range(len(names)):  # the ways take turns on each batch, each first in turn
            name = names[(i + k) % len(names)]
            objective, optimizer, undo, decoder = runs[name]
            tick = time.perf_counter()
            with undo(decoder):
                optimizer.zero_grad(set_to_none=True)
                objective.loss(batch).loss.total.backward()
                optimizer.step()
            if i >= WARMUP:
                seconds[name][repeat] += time.perf_counter() - tick
    shipped = seconds["the step as shipped"]
    print(f"{'way':32s} {'ms/step':>8s} {'x shipped':>10s}   (each repeat's ratio)")
    for name, times in seconds.items():
        ratios = ", ".join(f"{t / s:.2f}" for t, s in zip(times, shipped))
        print(f"{name:32s} {1000 * sum(times) / (args.steps * args.repeats):8.1f} {sum(times) / sum(shipped):10.2f}"
              f"   ({ratios})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
