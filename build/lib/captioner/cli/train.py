"""`captioner train`: train a model from a config, or resume a run exactly."""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from captioner.cli.common import add_device, add_encoder_weights, add_overrides, overrides


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a captioning model from a config",
                       description="Train a captioning model. Under `torchrun --nproc_per_node=N` the same "
                                   "command trains with N processes (DDP).")
    add_device(p)
    p.add_argument("--config", help="YAML config, or a shipped config's name (shapes, flickr8k-800, flickr8k, "
                                    "coco); not needed with --resume")
    p.add_argument("--data", help="folder or caption file, or 'shapes' (overrides data.path)")
    p.add_argument("--out", help="run folder for last.pt, best.pt, metrics.jsonl (default runs/<config name>, "
                                 "or the checkpoint's folder with --resume)")
    p.add_argument("--resume", metavar="RUN/last.pt",
                   help="continue a run exactly where its checkpoint left it (config from the checkpoint)")
    add_encoder_weights(p)
    add_overrides(p, "train.epochs=30")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from captioner.training import run_config, train

    if args.resume and args.config:
        logging.getLogger(__name__).warning("--config %s ignored: a resumed run uses its checkpoint's config "
                                            "(change it with section.key=value overrides)", args.config)
    cfg = run_config(args.config, overrides(args), resume=args.resume, data=args.data)
    if args.out:
        out = Path(args.out)
    elif args.resume:
        out = Path(args.resume).parent
    else:
        out = Path("runs") / Path(args.config).stem
    result = train(cfg, out, args.device, resume=args.resume)
    if os.environ.get("RANK", "0") == "0":
        best = "-" if result.best_value is None else f"{result.metric} {result.best_value:.4f} at step {result.best_step}"
        print(f"trained:  {result.epochs} epochs, {result.steps} steps"
              + (" (stopped early)" if result.stopped_early else ""))
        print(f"best:     {best} -> {result.best}")
        print(f"last:     {result.last}")
        print(f"metrics:  {result.out_dir / 'metrics.jsonl'}")
    return 0
