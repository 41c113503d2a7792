"""`captioner average`: one checkpoint whose weights are the mean of several (of one run)."""
from __future__ import annotations

import argparse


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("average", help="average the weights of several checkpoints of one model",
                       description="Average checkpoints of one model and vocabulary, e.g. the step-*.pt a run "
                                   "keeps with train.keep_validated=true: often a little better than any one.")
    p.add_argument("checkpoints", nargs="+", metavar="CKPT", help="checkpoints to average")
    p.add_argument("-o", "--out", required=True, help="the averaged checkpoint to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from captioner.files import writable_file
    from captioner.model.checkpoint import average_checkpoints, save_checkpoint

    writable_file(args.out, "checkpoint")
    avg = average_checkpoints(args.checkpoints)
    save_checkpoint(args.out, avg.config, avg.vocab, avg.model_state, None, avg.meta)
    print(f"averaged {len(args.checkpoints)} checkpoints -> {args.out}")
    return 0
