"""`captioner export`: a checkpoint as ONNX graphs for ONNX Runtime (captioner.deploy)."""
from __future__ import annotations

import argparse


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a checkpoint to ONNX (encoder, memory and step graphs + manifest)",
                       description="Write the encoder, the decoder's per-image memory and its step as ONNX graphs "
                                   "with dynamic batch axes, and a manifest; each graph is checked and compared "
                                   "with torch. Caption with it: captioner caption --runtime onnx --checkpoint DIR.")
    p.add_argument("--checkpoint", required=True, help="a checkpoint written by `captioner train`")
    p.add_argument("--format", choices=("onnx",), default="onnx", help="onnx (the only format so far)")
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="folder for the graphs and manifest.json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from captioner.deploy.export import export_onnx

    report = export_onnx(args.checkpoint, args.out)
    for path in report.files:
        print(f"wrote {path}")
    print("largest difference from torch: " + ", ".join(f"{k} {v:.1e}" for k, v in report.differences.items()))
    return 0
