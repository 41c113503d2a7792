"""`captioner demo`: train on the built-in shapes set, then caption and draw a held-out image."""
from __future__ import annotations

import argparse

from captioner.cli.common import add_device, add_overrides, print_evaluation


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train on the built-in shapes set, then caption and visualise a held-out image",
                       description="Offline, no data needed: builds the shapes set, trains a small model "
                                   "(the shipped shapes config) for a few CPU minutes, scores it on held-out "
                                   "images and draws where it looked for every word.")
    add_device(p)
    p.add_argument("--out", default="runs/demo", help="run folder (checkpoints, metrics, attention.png)")
    p.add_argument("--photos", metavar="DIR",
                   help="also caption the first 3 photos of DIR with the bundled Flickr8k model (besides "
                        "matplotlib's sample photo)")
    add_overrides(p, "train.epochs=5")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from captioner.recipes.demo import run_demo

    r = run_demo(args.out, args.device, args.overrides, args.photos)
    print(f"\ntrained {r.train.epochs} epochs ({r.train.steps} steps) -> {r.train.best or r.train.last}")
    print(f"held-out shapes test split, {len(r.evaluation.captions)} images:")
    print_evaluation(r.evaluation.metrics, r.evaluation.grounding)
    print(f"\n{r.example.path}\n  caption: {r.example.text}\n  attention picture: {r.picture}")
    if r.photos:
        print("\nreal photos, captioned by the bundled Flickr8k model (no training):")
    for caption, picture in r.photos:
        print(f"{caption.path}\n  caption: {caption.text}\n  attention picture: {picture}")
    return 0
