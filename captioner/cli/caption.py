"""`captioner caption`: one line (or one JSON line, with per-word attention) per image; with `--text`,
the given words on each image, each with its log-probability."""
from __future__ import annotations

import argparse
import glob
import json
import sys
from collections.abc import Iterable
from pathlib import Path

from captioner.cli.common import (add_batch_size, add_decode_options, add_device, add_runtime, add_text,
                                  decode_overrides, load_captioner, refuse_empty_paths, word_logprobs)
from captioner.errors import CaptionerError


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("caption", help="caption images with a trained checkpoint")
    add_device(p)
    p.add_argument("images", nargs="+", metavar="IMG", help="image files, folders (their images) or glob patterns")
    add_decode_options(p, bundled=True)
    add_batch_size(p)
    add_runtime(p)
    p.add_argument("--json", action="store_true",
                   help="JSON lines: path, caption, tokens, score, attention (per word, rows x cols, sums to 1), "
                        "word_logprobs (with --text)")
    add_text(p, "score every image with")
    p.set_defaults(func=run)


def expand_images(items: list[str]) -> tuple[list[str], list[str]]:
    """Files named as given (any extension); folders and glob patterns (expanded here too: quoted on
    the shell, or on Windows) -> their image files by extension, sorted. Returns (paths, problems):
    a folder or pattern without images is a problem, reported like an unreadable image."""
    from captioner.data.images import IMAGE_SUFFIXES, is_image_file  # numpy and Pillow: not for `--help`

    def images_in(candidates: Iterable[Path]) -> list[str]:
        return sorted(str(f) for f in candidates if is_image_file(f))

    paths: list[str] = []
    problems: list[str] = []
    for item in items:
        if Path(item).is_dir():
            found = images_in(Path(item).iterdir())
        elif any(c in item for c in "*?[") and not Path(item).exists():
            matches = [Path(m) for m in sorted(glob.glob(item, recursive=True))]
            found = images_in(matches) + images_in(f for m in matches if m.is_dir() for f in m.iterdir())
        else:
            paths.append(item)
            continue
        paths += found
        if not found:
            problems.append(f"{item}: no image files ({' '.join(IMAGE_SUFFIXES)}) found here")
    return paths, problems


def run(args: argparse.Namespace) -> int:
    if sys.stdout is None:  # started with stdout closed (`>&-`): the captions could go nowhere
        raise CaptionerError("standard output is closed: nowhere to print the captions")
    settings = decode_overrides(args)
    refuse_empty_paths([("IMG", image) for image in args.images])
    paths, problems = expand_images(args.images)
    if not paths:
        raise CaptionerError(problems[0] if len(problems) == 1 else f"{' '.join(args.images)}: no image files found")
    captioner = load_captioner(args)
    if args.text is not None:
        from captioner.decoding.text import text_ids

        text_ids(args.text, captioner.vocab)  # an unknown word: one line now, before any image is read
        settings["text"] = args.text
    for problem in problems:
        print(f"captioner: error: {problem}", file=sys.stderr, flush=True)
    failed = len(problems)
    for path, result in captioner.caption_files(paths, args.batch_size, **settings):
        if isinstance(result, CaptionerError):
            print(f"captioner: error: {result}", file=sys.stderr, flush=True)
            failed += 1
        elif args.json:
            print(json.dumps(result.to_json()), flush=True)
        elif args.text is not None:
            print(f"{path}\t{result.text}\t{word_logprobs(result)}", flush=True)
        else:
            print(f"{path}\t{result.text}", flush=True)
    if failed:
        print(f"captioner: {failed} of {len(paths) + len(problems)} inputs could not be captioned", file=sys.stderr)
    return 1 if failed else 0
