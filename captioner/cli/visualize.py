"""`captioner visualize`: the photo, then one panel per word with where the model looked (for its own
caption, or with `--text` for the words given)."""
from __future__ import annotations

import argparse

from captioner.cli.common import (add_decode_options, add_device, add_runtime, add_text, decode_overrides,
                                  load_captioner, refuse_empty_paths, use_bundled_model, word_logprobs)
from captioner.errors import CaptionerError
from captioner.files import writable_dir, writable_file


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("visualize", help="draw where the model looked for every word")
    add_device(p)
    p.add_argument("image", metavar="IMG", help="the image to caption")
    add_decode_options(p, bundled=True)
    add_runtime(p)
    add_text(p, "draw where the model would look for")
    p.add_argument("-o", "--out", required=True, help="PNG to write: the photo, then one panel per word")
    p.add_argument("--per-word", metavar="DIR", help="also write one PNG per word into DIR")
    p.add_argument("--gif", metavar="OUT.gif", help="also write an animated GIF, one frame per word")
    p.add_argument("--boxes", metavar="FILE",
                   help="object boxes (JSON lines or COCO instances, as `evaluate --boxes`): outline the boxes of "
                        "each word that names one, green when its map's peak is inside, red when not")
    p.add_argument("--relevance", action="store_true",
                   help="draw each word's gradient relevance (where its evidence is, Grad-CAM style: gradient x "
                        "feature per region) instead of the attention; needs --runtime torch")
    p.add_argument("--opacity", "--alpha", type=float, default=0.6, dest="opacity",
                   help="opacity of the attention colours, 0..1 (default 0.6; --alpha is its old name)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from captioner.data.images import load_image
    from captioner.pictures.figures import plot_attention

    settings = decode_overrides(args)
    refuse_empty_paths([("IMG", args.image), ("--out", args.out), ("--per-word", args.per_word), ("--gif", args.gif),
                        ("--boxes", args.boxes)])
    for path, what in ((args.out, "picture"), (args.gif, "GIF")):
        if path:
            writable_file(path, what, inputs=[args.image])  # before the model loads, not after
    if args.per_word:
        writable_dir(args.per_word, "folder for the per-word pictures")
    if not 0 <= args.opacity <= 1:
        raise CaptionerError(f"--opacity must be in [0, 1], got {args.opacity}")
    bundled = args.checkpoint is None
    if bundled:
        use_bundled_model(args)  # an ONNX export
    if args.relevance and args.runtime == "onnx":
        what = ("--checkpoint CKPT (a checkpoint of `captioner train`): the bundled model runs on ONNX" if bundled
                else "--runtime torch")
        raise CaptionerError(f"--relevance needs the decoder's gradients: use {what}")
    objects = None
    if args.boxes:
        from pathlib import Path

        from captioner.data.boxes import read_boxes

        objects = read_boxes(args.boxes).get(Path(args.image).name)
        if objects is None:
            raise CaptionerError(f"{args.boxes}: no boxes for {Path(args.image).name}")
    image = load_image(args.image)  # the picture, in full (and a bad file named before the model loads)
    captioner = load_captioner(args)
    (caption,) = captioner.caption([args.image], text=args.text, **settings)  # read as `caption` reads it
    if args.relevance:
        from captioner.decoding.relevance import with_relevance

        caption = with_relevance(captioner, load_image(args.image, draft=captioner.image_side), caption)
    out = plot_attention(image, caption, args.out, per_word_dir=args.per_word, gif_path=args.gif,
                         opacity=args.opacity, objects=objects, relevance=args.relevance)
    print(f"{args.image}\t{caption.text}" + (f"\t{word_logprobs(caption)}" if args.text is not None else ""))
    print(f"wrote {out}")
    if args.per_word:
        print(f"wrote {len(caption.tokens)} PNGs to {args.per_word}")
    if args.gif:
        print(f"wrote {args.gif}")
    return 0
