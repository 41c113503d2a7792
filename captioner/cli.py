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


def _add_encoder_weights(p: argparse.ArgumentParser) -> None:
    p.add_argument("--encoder-weights", metavar="PATH",
                   help="local state dict for the encoder (same as model.encoder.weights=PATH), e.g. for "
                        "torchvision backbones on a machine that cannot download them")


def _overrides(args) -> list[str]:
    """The positional section.key=value overrides, plus those the named options stand for."""
    extra = [f"model.encoder.weights={args.encoder_weights}"] if getattr(args, "encoder_weights", None) else []
    return list(args.overrides) + extra


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="captioner", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_demo, _add_prepare, _add_train, _add_caption, _add_visualize, _add_evaluate):
        add(sub)
    return parser


# --- demo --------------------------------------------------------------------------------------


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="train on the built-in shapes set, then caption and visualise a held-out image",
                       description="Offline, no data needed: builds the shapes set, trains a small model "
                                   "(configs/shapes.yaml) for a few CPU minutes, scores it on held-out images "
                                   "and draws where it looked for every word.")
    _add_common(p)
    p.add_argument("--out", default="runs/demo", help="run folder (checkpoints, metrics, attention.png)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, e.g. train.epochs=5")
    p.set_defaults(func=_run_demo)


def _run_demo(args) -> int:
    from captioner.demo import run_demo

    r = run_demo(args.out, args.device, args.overrides)
    print(f"\ntrained {r.train.epochs} epochs ({r.train.steps} steps) -> {r.train.best or r.train.last}")
    print(f"held-out shapes test split, {len(r.evaluation.captions)} images:")
    _print_evaluation(r.evaluation.metrics, r.evaluation.grounding)
    print(f"\n{r.example.path}\n  caption: {r.example.text}\n  attention picture: {r.picture}")
    return 0


# --- prepare -----------------------------------------------------------------------------------


def _add_prepare(sub) -> None:
    p = sub.add_parser("prepare", help="build the vocabulary and the feature cache for a data set")
    _add_common(p)
    p.add_argument("--data", help="folder or caption file (layout detected), or 'shapes'; default: data.path")
    p.add_argument("--config", help="YAML config (data and model.encoder sections are used)")
    p.add_argument("--out", default="runs/prepare", help="folder for vocab.json and (by default) cache/")
    p.add_argument("--image-root", help="folder holding the images, when not next to the caption file")
    p.add_argument("--batch-size", type=int, default=32, help="images per encoder batch")
    _add_encoder_weights(p)
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, e.g. data.min_word_count=5")
    p.set_defaults(func=_run_prepare)


def _run_prepare(args) -> int:
    import dataclasses

    from captioner.config import load_config
    from captioner.prepare import prepare
    from captioner.runtime import resolve_device

    cfg = load_config(args.config, _overrides(args))
    data = dataclasses.replace(cfg.data, path=args.data) if args.data else cfg.data
    s = prepare(data, cfg.model.encoder, args.out, device=resolve_device(args.device), image_root=args.image_root,
                batch_size=args.batch_size, progress=sys.stderr.isatty())
    print(f"data:        {s.data}")
    for split in s.images:
        if s.images[split]:
            print(f"  {split:<6} {s.images[split]:>7,} images {s.captions[split]:>9,} captions")
    print(f"  total  {sum(s.images.values()):>7,} images {sum(s.captions.values()):>9,} captions")
    if s.skipped:
        print(f"skipped:     {len(s.skipped)} images")
        for path, reason in s.skipped[:20]:
            print(f"  {path}: {reason}")
        if len(s.skipped) > 20:
            print(f"  ... and {len(s.skipped) - 20} more")
    print(f"vocabulary:  {s.vocab_size:,} words (min count {data.min_word_count}) -> {s.vocab_path}")
    if s.cache_path is not None:
        print(f"cache:       {s.cache_mb:,.1f} MB ({s.built} encoded now, {s.reused} reused) -> {s.cache_path}")
    for note in s.notes:
        print(f"note:        {note}")
    return 0


# --- train -------------------------------------------------------------------------------------


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a captioning model from a config",
                       description="Train a captioning model. Under `torchrun --nproc_per_node=N` the same "
                                   "command trains with N processes (DDP).")
    _add_common(p)
    p.add_argument("--config", help="YAML config (see configs/); not needed with --resume")
    p.add_argument("--data", help="folder or caption file, or 'shapes' (overrides data.path)")
    p.add_argument("--out", help="run folder for last.pt, best.pt, metrics.jsonl (default runs/<config name>, "
                                 "or the checkpoint's folder with --resume)")
    p.add_argument("--resume", metavar="RUN/last.pt",
                   help="continue a run exactly where its checkpoint left it (config from the checkpoint)")
    _add_encoder_weights(p)
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides, e.g. train.epochs=30")
    p.set_defaults(func=_run_train)


def _run_train(args) -> int:
    import os
    from pathlib import Path

    from captioner.train import run_config, train

    if args.resume and args.config:
        logging.getLogger(__name__).warning("--config %s ignored: a resumed run uses its checkpoint's config "
                                            "(change it with section.key=value overrides)", args.config)
    cfg = run_config(args.config, _overrides(args), resume=args.resume, data=args.data)
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


# --- caption -----------------------------------------------------------------------------------

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")


def _add_decode_options(p: argparse.ArgumentParser) -> None:
    """Decode settings; left out = the checkpoint's own (else the defaults: beam 5, 20 words)."""
    p.add_argument("--checkpoint", required=True, help="a checkpoint written by `captioner train`")
    p.add_argument("--beam", type=int, dest="beam_size", metavar="K",
                   help="beam size, 1 = greedy (default: the checkpoint's decode settings, else 5)")
    p.add_argument("--max-length", type=int, metavar="N", help="most words per caption (default: checkpoint's, else 20)")
    p.add_argument("--length-penalty", type=float, metavar="ALPHA",
                   help="rank by logprob / length**ALPHA (default: checkpoint's, else 1.0)")
    p.add_argument("--no-repeat-ngram", type=int, metavar="N",
                   help="never repeat an N-gram (default: checkpoint's, else 0 = off)")
    p.add_argument("--batch-size", type=int, default=32, help="images per batch (default 32)")


def _decode_overrides(args) -> dict:
    for flag, value in (("--beam", args.beam_size), ("--max-length", args.max_length), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:
            raise CaptionerError(f"{flag} must be at least 1, got {value}")
    if args.no_repeat_ngram is not None and args.no_repeat_ngram < 0:
        raise CaptionerError(f"--no-repeat-ngram must be 0 (off) or more, got {args.no_repeat_ngram}")
    return {"beam_size": args.beam_size, "max_length": args.max_length, "length_penalty": args.length_penalty,
            "no_repeat_ngram": args.no_repeat_ngram}


def _add_caption(sub) -> None:
    p = sub.add_parser("caption", help="caption images with a trained checkpoint")
    _add_common(p)
    p.add_argument("images", nargs="+", metavar="IMG", help="image files, folders (their images) or glob patterns")
    _add_decode_options(p)
    p.add_argument("--json", action="store_true",
                   help="JSON lines: path, caption, tokens, score, attention (per word, rows x cols, sums to 1)")
    p.set_defaults(func=_run_caption)


def _expand_images(items: list[str]) -> tuple[list[str], list[str]]:
    """Files named as given (any extension); folders and glob patterns (expanded here too: quoted on
    the shell, or on Windows) -> their image files by extension, sorted. Returns (paths, problems):
    a folder or pattern without images is a problem, reported like an unreadable image."""
    import glob
    from pathlib import Path

    def images_in(candidates) -> list[str]:
        return sorted(str(f) for f in candidates if f.is_file() and f.suffix.lower() in IMAGE_EXTENSIONS)

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
            problems.append(f"{item}: no image files ({' '.join(IMAGE_EXTENSIONS)}) found here")
    return paths, problems


def _run_caption(args) -> int:
    import json

    from captioner.inference import Captioner

    overrides = _decode_overrides(args)
    paths, problems = _expand_images(args.images)
    if not paths:
        raise CaptionerError(problems[0] if len(problems) == 1 else f"{' '.join(args.images)}: no image files found")
    captioner = Captioner.from_checkpoint(args.checkpoint, args.device)
    for problem in problems:
        print(f"captioner: error: {problem}", file=sys.stderr, flush=True)
    failed = len(problems)
    for path, result in captioner.caption_files(paths, args.batch_size, **overrides):
        if isinstance(result, CaptionerError):
            print(f"captioner: error: {result}", file=sys.stderr, flush=True)
            failed += 1
        elif args.json:
            print(json.dumps(result.to_json()), flush=True)
        else:
            print(f"{path}\t{result.text}", flush=True)
    if failed:
        print(f"captioner: {failed} of {len(paths) + len(problems)} inputs could not be captioned", file=sys.stderr)
    return 1 if failed else 0


# --- visualize ---------------------------------------------------------------------------------


def _add_visualize(sub) -> None:
    p = sub.add_parser("visualize", help="draw where the model looked for every word")
    _add_common(p)
    p.add_argument("image", metavar="IMG", help="the image to caption")
    _add_decode_options(p)
    p.add_argument("-o", "--out", required=True, help="PNG to write: the photo, then one panel per word")
    p.add_argument("--per-word", metavar="DIR", help="also write one PNG per word into DIR")
    p.add_argument("--gif", metavar="OUT.gif", help="also write an animated GIF, one frame per word")
    p.add_argument("--alpha", type=float, default=0.6, help="opacity of the attention colours (default 0.6)")
    p.set_defaults(func=_run_visualize)


def _run_visualize(args) -> int:
    from captioner.images import load_image
    from captioner.inference import Captioner
    from captioner.visualize import plot_attention

    overrides = _decode_overrides(args)
    image = load_image(args.image)
    captioner = Captioner.from_checkpoint(args.checkpoint, args.device)
    (caption,) = captioner.caption([image], **overrides)
    caption.path = args.image
    out = plot_attention(image, caption, args.out, per_word_dir=args.per_word, gif_path=args.gif, alpha=args.alpha)
    print(f"{args.image}\t{caption.text}")
    print(f"wrote {out}")
    if args.per_word:
        print(f"wrote {len(caption.tokens)} PNGs to {args.per_word}")
    if args.gif:
        print(f"wrote {args.gif}")
    return 0


# --- evaluate ----------------------------------------------------------------------------------


def _add_evaluate(sub) -> None:
    p = sub.add_parser("evaluate", help="caption a split and score it (BLEU, METEOR, ROUGE-L, CIDEr-D, grounding)")
    _add_common(p)
    _add_decode_options(p)
    p.add_argument("--data", help="folder or caption file (layout detected), or 'shapes'; default: the checkpoint's")
    p.add_argument("--image-root", help="folder holding the images, when not next to the caption file")
    p.add_argument("--split", default="test", choices=("train", "val", "test"), help="split to score (default test)")
    p.add_argument("--limit", type=int, help="score only the first N images of the split")
    p.add_argument("--out", help="write metrics and the generated captions to this JSON file")
    p.add_argument("--no-meteor", action="store_true", help="skip METEOR (it starts a Java process, ~10 s)")
    p.set_defaults(func=_run_evaluate)


def _checkpoint_data_config(meta: dict, train_state: dict | None):
    """The DataConfig the checkpoint was trained with (meta["data"] / meta["config"]["data"] /
    train_state["config"]["data"]), else the defaults."""
    from captioner.config import ConfigError, DataConfig, from_dict

    for found in (meta.get("data"), (meta.get("config") or {}).get("data"),
                  ((train_state or {}).get("config") or {}).get("data")):
        if isinstance(found, dict):
            try:
                return from_dict(DataConfig, found, "data")
            except ConfigError as e:
                logging.getLogger(__name__).warning("ignoring the checkpoint's data settings: %s", e)
    return DataConfig()


def _print_evaluation(metrics: dict, grounding, meteor_note: str = "java not found") -> None:
    """The metric table (and attention grounding when the data has boxes)."""
    print(f"{'metric':<10}{'score':>8}")
    for name, value in metrics.items():
        print(f"{name:<10}{value:>8.4f}" if name != "CIDEr" else f"{'CIDEr-D':<10}{value:>8.4f}")
    if "METEOR" not in metrics and metrics:
        print(f"{'METEOR':<10}{'skipped':>8}  ({meteor_note})")
    if grounding is not None:
        g = grounding
        print(f"grounding over {g.words} object words: hit rate {g.hit_rate:.3f} (attention peak in the object's box), "
              f"mean mass {g.mean_mass:.3f} (attention inside the box)")


def _run_evaluate(args) -> int:
    import dataclasses
    import json
    from pathlib import Path

    from captioner.checkpoint import load_checkpoint, restore_model
    from captioner.inference import Captioner, decode_config_from_meta, evaluate
    from captioner.runtime import resolve_device
    from captioner.prepare import load_data_records

    overrides = _decode_overrides(args)
    if args.limit is not None and args.limit < 1:
        raise CaptionerError(f"--limit must be at least 1, got {args.limit}")
    ckpt = load_checkpoint(args.checkpoint)
    data = _checkpoint_data_config(ckpt.meta, ckpt.train_state)
    path = args.data or data.path
    records = load_data_records(dataclasses.replace(data, path=str(path)), args.image_root)
    chosen = [r for r in records if r.split == args.split][: args.limit]
    if not chosen:
        counts = ", ".join(f"{s} {sum(r.split == s for r in records)}" for s in ("train", "val", "test"))
        raise CaptionerError(f"{path}: no images in split '{args.split}' ({counts}); choose another with --split")
    captioner = Captioner(restore_model(ckpt, args.checkpoint), ckpt.vocab, decode_config_from_meta(ckpt.meta),
                          resolve_device(args.device), ckpt.meta)
    del ckpt  # the optimiser state, if any, is not needed
    progress = None
    if sys.stderr.isatty():
        import functools

        from tqdm import tqdm

        progress = functools.partial(tqdm, total=len(chosen), desc="captioning", unit="img")
    result = evaluate(captioner, chosen, args.batch_size, meteor=False if args.no_meteor else None,
                      progress=progress, **overrides)
    d = result.decode
    print(f"data:     {path} ({args.split}: {len(result.captions)} images captioned, {len(result.skipped)} skipped)")
    print(f"decode:   beam {d.beam_size}, max length {d.max_length}, length penalty {d.length_penalty}"
          f"{f', no repeat {d.no_repeat_ngram}-grams' if d.no_repeat_ngram else ''}")
    _print_evaluation(result.metrics, result.grounding, "--no-meteor" if args.no_meteor else "java not found")
    for p, reason in result.skipped[:20]:
        print(f"skipped:  {p}: {reason}")
    if len(result.skipped) > 20:
        print(f"skipped:  ... and {len(result.skipped) - 20} more")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        report = {"checkpoint": str(args.checkpoint), "data": str(path), "split": args.split, **result.to_json()}
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out}")
    return 0 if result.captions else 1


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
