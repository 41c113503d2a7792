"""`captioner evaluate`: caption a split and score it (BLEU, METEOR, ROUGE-L, CIDEr-D, object
hallucination, grounding)."""
from __future__ import annotations

import argparse
import json
import sys

from captioner.cli.common import (
    add_batch_size,
    add_decode_options,
    add_device,
    add_runtime,
    decode_overrides,
    load_captioner,
    print_evaluation,
    print_grounding,
    refuse_export_folders,
)
from captioner.errors import CaptionerError
from captioner.files import atomic_write_text, writable_file


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="caption a split and score it (BLEU, METEOR, ROUGE-L, CIDEr-D, "
                                          "object hallucination, grounding)")
    add_device(p)
    add_decode_options(p)
    add_batch_size(p)
    p.add_argument("--data", help="folder or caption file (layout detected), or 'shapes'; default: the checkpoint's")
    p.add_argument("--image-root", help="folder holding the images, when not next to the caption file")
    p.add_argument("--split", default="test", choices=("train", "val", "test"), help="split to score (default test)")
    p.add_argument("--limit", type=int, help="score only the first N images of the split")
    p.add_argument("--out", help="write metrics and the generated captions to this JSON file")
    p.add_argument("--no-meteor", action="store_true", help="skip METEOR (it starts a Java process, ~10 s)")
    p.add_argument("--boxes", metavar="FILE",
                   help="object boxes for the grounding score (pointing game): JSON lines "
                        "{image, objects: [{words, boxes}]} or a COCO instances JSON")
    p.add_argument("--relevance", action="store_true",
                   help="with --boxes, also score gradient relevance maps (where each word's evidence is, "
                        "Grad-CAM style) on the same words; the attention scores stay the decoder's own")
    add_runtime(p)
    p.set_defaults(func=run)


def _tqdm(items, total):
    from tqdm import tqdm

    return tqdm(items, total=total, desc="captioning", unit="img")


def run(args: argparse.Namespace) -> int:
    from captioner.data.boxes import read_boxes
    from captioner.decoding.evaluation import evaluate_split
    from captioner.recipes.evaluate import evaluate_checkpoint

    settings = decode_overrides(args)
    if args.limit is not None and args.limit < 1:
        raise CaptionerError(f"--limit must be at least 1, got {args.limit}")
    if args.out:
        writable_file(args.out, "report")  # before minutes of captioning, not after
    if args.relevance and not args.boxes:
        raise CaptionerError("--relevance scores maps against object boxes: give --boxes FILE too")
    if args.relevance and args.runtime == "onnx":
        raise CaptionerError("--relevance needs the decoder's gradients: use --runtime torch")
    boxes = read_boxes(args.boxes) if args.boxes else None  # a bad file fails before any captioning
    options = {"meteor": False if args.no_meteor else None, "progress": _tqdm if sys.stderr.isatty() else None,
               "boxes": boxes, "relevance": args.relevance}
    if args.runtime == "onnx":  # an export folder or a checkpoint; the data settings from its manifest
        from captioner.deploy.runtime import exported_data

        captioner = load_captioner(args, teacher_forcing=True)  # the reference captions' grounding
        result, data = evaluate_split(captioner, exported_data(args.checkpoint[0]), args.split, args.data,
                                      args.image_root, args.limit, args.batch_size, **options, **settings)
    else:
        refuse_export_folders(args.checkpoint)
        result, data = evaluate_checkpoint(args.checkpoint, args.split, args.data, args.image_root, args.limit,
                                           args.device, args.batch_size, **options, **settings)
    d = result.decode
    print(f"data:     {data} ({args.split}: {len(result.captions)} images captioned, {len(result.skipped)} skipped)")
    print(f"decode:   beam {d.beam_size}, max length {d.max_length}, length penalty {d.length_penalty}"
          f"{f', no repeat {d.no_repeat_ngram}-grams' if d.no_repeat_ngram else ''}"
          f"{', no content word twice' if d.no_repeat_words else ''}"
          f"{f', word detector weight {d.detector_weight:g}' if d.detector_weight else ''}")
    chair = None if result.hallucination is None else (result.hallucination, result.reference_hallucination)
    print_evaluation(result.metrics, result.grounding, "--no-meteor" if args.no_meteor else "java not found",
                     result.diversity, result.focus, chair)
    if boxes is not None and result.grounding is None:
        print(f"grounding: none of the {len(result.captions)} captioned images is in {args.boxes}")
    if result.reference_grounding is not None:
        print_grounding(result.reference_grounding, "teacher-forced on the reference captions")
    for kind, what in (("generated", "generated captions"), ("reference", "the reference captions")):
        if kind in result.relevance:
            print_grounding(result.relevance[kind], f"gradient relevance, not attention: {what}")
    for path, reason in result.skipped[:20]:
        print(f"skipped:  {path}: {reason}")
    if len(result.skipped) > 20:
        print(f"skipped:  ... and {len(result.skipped) - 20} more")
    if args.out:
        checkpoint = str(args.checkpoint[0]) if len(args.checkpoint) == 1 else args.checkpoint
        report = {"checkpoint": checkpoint, "data": data, "split": args.split, **result.to_json()}
        print(f"wrote {atomic_write_text(args.out, json.dumps(report, indent=1) + chr(10))}")
    return 0 if result.captions else 1
