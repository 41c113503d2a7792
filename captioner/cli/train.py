"""`captioner train`: train a model from a config, or resume a run exactly."""
from __future__ import annotations

import argparse
import logging
import os
import signal
from pathlib import Path

from captioner.cli.common import add_device, add_encoder_weights, add_overrides, overrides
from captioner.errors import CaptionerError


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
    p.add_argument("--init", metavar="CKPT",
                   help="start from this checkpoint's weights, vocabulary and model config (train.init=CKPT); "
                        "self-critical training (train.objective=scst) fine-tunes one this way")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run --out holds (its files stay until the new run's first checkpoint)")
    p.add_argument("--image-root", help="folder holding the images, when not next to the caption file "
                                        "(same as data.image_root=PATH)")
    add_encoder_weights(p)
    add_overrides(p, "train.epochs=30")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from captioner.recipes.train import run_config, train

    if args.resume and args.config:
        logging.getLogger(__name__).warning("--config %s ignored: a resumed run uses its checkpoint's config "
                                            "(change it with section.key=value overrides)", args.config)
    extra = [f"data.image_root={args.image_root}"] if args.image_root else []
    extra += [f"train.init={args.init}"] if args.init else []
    cfg = run_config(args.config, overrides(args) + extra, resume=args.resume, data=args.data)
    if args.out:
        out = Path(args.out)
    elif args.resume:
        out = Path(args.resume).parent
    else:
        out = Path("runs") / (Path(args.config).stem if args.config else "train")
    _keep_config_file(args.config, out)
    result = train(cfg, out, args.device, resume=args.resume, overwrite=args.overwrite)
    if result.interrupted is not None:
        if os.environ.get("RANK", "0") == "0":
            print(f"stopped by {signal.Signals(result.interrupted).name} after step {result.steps}: {result.last} "
                  f"written.\nresume with: captioner train --resume {result.last}")
        return 128 + result.interrupted
    if os.environ.get("RANK", "0") == "0":
        best = "-" if result.best_value is None else f"{result.metric} {result.best_value:.4f} at step {result.best_step}"
        print(f"trained:  {result.epochs} epochs, {result.steps} steps"
              + (" (stopped early)" if result.stopped_early else ""))
        print(f"best:     {best} -> {result.best}")
        print(f"last:     {result.last}")
        print(f"metrics:  {result.out_dir / 'metrics.jsonl'}")
    return 0


def _keep_config_file(config: str | None, out: Path) -> None:
    """A run writes its resolved config to OUT/config.yaml: refuse an --out that would replace the
    config file the command reads (its comments and layout lost) before anything starts."""
    from captioner.training.state import CONFIG

    written = out / CONFIG
    if config and Path(config).is_file() and written.is_file() and os.path.samefile(config, written):
        raise CaptionerError(f"{config}: is the config this command reads, and the run would write its resolved "
                             f"config over it; give another --out, or copy the config out of {out}")
