"""The `captioner` command: one entry point, a subcommand per job. A thin layer over the library.

Each subcommand has an `_add_<name>(subparsers)` that declares its arguments and a
`_run_<name>(args) -> int` that calls the library with plain values.
"""
from __future__ import annotations

import argparse
import logging
import sys

from captioner.errors import CaptionerError


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (cuda when present, else cpu), cpu, cuda, cuda:1, ...")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="captioner", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_demo, _add_prepare, _add_train, _add_caption, _add_visualize, _add_evaluate):
        add(sub)
    return parser


# --- demo --------------------------------------------------------------------------------------


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="train on the built-in shapes set, then caption and visualise a held-out image")
    _add_common(p)
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    raise CaptionerError("demo is not implemented yet")


# --- prepare -----------------------------------------------------------------------------------


def _add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="build the vocabulary and the feature cache for a data set")
    _add_common(p)
    p.set_defaults(func=_run_prepare)


def _run_prepare(args) -> int:
    raise CaptionerError("prepare is not implemented yet")


# --- train -------------------------------------------------------------------------------------


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a captioning model from a config")
    _add_common(p)
    p.set_defaults(func=_run_train)


def _run_train(args) -> int:
    raise CaptionerError("train is not implemented yet")


# --- caption -----------------------------------------------------------------------------------


def _add_caption(sub) -> None:
    p = sub.add_parser("caption", help="caption images with a trained checkpoint")
    _add_common(p)
    p.set_defaults(func=_run_caption)


def _run_caption(args) -> int:
    raise CaptionerError("caption is not implemented yet")


# --- visualize ---------------------------------------------------------------------------------


def _add_visualize(sub) -> None:
    p = sub.add_parser("visualize", help="draw where the model looked for every word")
    _add_common(p)
    p.set_defaults(func=_run_visualize)


def _run_visualize(args) -> int:
    raise CaptionerError("visualize is not implemented yet")


# --- evaluate ----------------------------------------------------------------------------------


def _add_evaluate(sub) -> None:
    p = sub.add_parser("evaluate", help="caption a split and score it (BLEU, METEOR, ROUGE-L, CIDEr-D, grounding)")
    _add_common(p)
    p.set_defaults(func=_run_evaluate)


def _run_evaluate(args) -> int:
    raise CaptionerError("evaluate is not implemented yet")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(message)s")
    try:
        return args.func(args)
    except CaptionerError as e:
        print(f"captioner: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
