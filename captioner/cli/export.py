"""`captioner export`: a checkpoint as ONNX graphs for ONNX Runtime (captioner.deploy)."""
from __future__ import annotations

import argparse

from captioner.cli.common import add_decode_flags, decode_overrides
from captioner.deploy import CALIBRATION_IMAGES, SMALL_WEIGHTS
from captioner.errors import CaptionerError


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a checkpoint to ONNX (encoder, memory and step graphs + manifest)",
                       description="Write the encoder, the decoder's per-image memory and its step as ONNX graphs "
                                   "with dynamic batch axes, and a manifest; each graph is checked and compared "
                                   "with torch. Caption with it: captioner caption --runtime onnx --checkpoint DIR.")
    p.add_argument("--checkpoint", required=True, help="a checkpoint written by `captioner train`")
    p.add_argument("--format", choices=("onnx",), default="onnx", help="onnx (the only format so far)")
    p.add_argument("-o", "--out", required=True, metavar="DIR", help="folder for the graphs and manifest.json")
    p.add_argument("--quantize", choices=("int8", "float16"),
                   help="int8: the encoder quantized to 8-bit integers (~2.2x faster on a CPU, captions change a "
                        "little; score it with captioner evaluate --runtime onnx); needs --calibration. float16: "
                        "the encoder's weights stored in float16 (half the file, computed in float32 as before, "
                        "grids within ~0.3%%)")
    p.add_argument("--small", nargs="?", const="float16", choices=SMALL_WEIGHTS,
                   help="the decoder's weights in float16 (--small alone) or int8 (one scale per row; captions change "
                        "a little: score it with captioner evaluate --runtime onnx) and no token tables: a quarter "
                        "or an eighth of the decoder graphs' size, for shipping a model (the step a little slower)")
    p.add_argument("--calibration", nargs="+", metavar="IMG",
                   help="photos like those you will caption (files, folders or glob patterns; up to "
                        f"{CALIBRATION_IMAGES} evenly spaced are used), for --quantize int8")
    group = p.add_argument_group("decode defaults recorded in the manifest (what `caption` and `serve` use with "
                                 "the export; left out = the checkpoint's)")
    add_decode_flags(group)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from captioner.cli.caption import expand_images
    from captioner.deploy.export import export_onnx

    decode = decode_overrides(args)  # checked before the checkpoint loads

    if args.quantize == "float16" and args.calibration:
        raise CaptionerError("--calibration is for --quantize int8: a float16 encoder needs no photos")
    if (args.quantize == "int8") != bool(args.calibration):
        raise CaptionerError("--quantize int8 and --calibration IMG go together: the int8 ranges are calibrated "
                             "on photos")
    calibration = None
    if args.calibration:
        calibration, problems = expand_images(args.calibration)
        if problems:
            raise CaptionerError(problems[0])
    report = export_onnx(args.checkpoint, args.out, int8_calibration=calibration, small=args.small, decode=decode,
                         float16_encoder=args.quantize == "float16")
    for path in report.files:
        print(f"wrote {path}")
    print("largest difference from torch: " + ", ".join(f"{k} {v:.1e}" for k, v in report.differences.items()))
    if report.encoder_difference is not None:
        where = " on the calibration photos" if args.quantize == "int8" else ""
        print(f"{args.quantize} encoder: its grids differ from float32 by {report.encoder_difference:.2%} "
              f"(relative){where}")
    return 0
