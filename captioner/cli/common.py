"""Arguments several subcommands share, and the printing of evaluation results."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from captioner.errors import CaptionerError


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (cuda when present, else cpu), cpu, cuda, cuda:1, ...")


def add_encoder_weights(p: argparse.ArgumentParser) -> None:
    p.add_argument("--encoder-weights", metavar="PATH",
                   help="local state dict for the encoder (same as model.encoder.weights=PATH), e.g. for "
                        "torchvision backbones on a machine that cannot download them")


def add_overrides(p: argparse.ArgumentParser, example: str) -> None:
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help=f"config overrides, e.g. {example}")


def overrides(args: argparse.Namespace) -> list[str]:
    """The positional section.key=value overrides, plus those the named options stand for."""
    extra = [f"model.encoder.weights={args.encoder_weights}"] if getattr(args, "encoder_weights", None) else []
    return list(args.overrides) + extra


def add_decode_options(p: argparse.ArgumentParser, bundled: bool = False) -> None:
    """Decode settings; left out = the checkpoint's own. `bundled`: --checkpoint may be left out, for
    the model bundled with the package (`load_captioner`)."""
    p.add_argument("--checkpoint", required=not bundled, nargs="+", metavar="CKPT",
                   help="a checkpoint written by `captioner train`; several (one encoder and vocabulary) decode "
                        "as an ensemble" + ("; default: the model bundled with the package, when it holds one"
                                            if bundled else ""))
    add_decode_flags(p)


def add_decode_flags(p: argparse._ActionsContainer) -> None:
    """--beam, --max-length, --length-penalty, --no-repeat-ngram, --no-repeat-words / --repeat-words;
    left out = the checkpoint's own (read back with `decode_overrides`)."""
    from captioner.config import LIMITS

    p.add_argument("--beam", type=int, dest="beam_size", metavar="K",
                   help=f"beam size, 1 = greedy, {LIMITS['decode']['beam_size']} (every beam holds its own state: "
                        f"--beam 5000 took 4.5 GB) (default: the checkpoint's decode settings)")
    p.add_argument("--max-length", type=int, metavar="N", help="most words per caption (default: the checkpoint's)")
    p.add_argument("--length-penalty", type=float, metavar="EXPONENT",
                   help=f"rank by logprob / length**EXPONENT, EXPONENT {LIMITS['decode']['length_penalty']} "
                        f"(length**300 overflows at 11 words) (default: the checkpoint's)")
    p.add_argument("--no-repeat-ngram", type=int, metavar="N",
                   help="never repeat an N-gram (default: the checkpoint's; 0 = off)")
    words = p.add_mutually_exclusive_group()
    words.add_argument("--no-repeat-words", dest="no_repeat_words", action="store_const", const=True,
                       help="a content word at most once per caption: no 'a hat and a hat' (function words such as "
                            "'a', 'in' may repeat; default: the checkpoint's)")
    words.add_argument(DECODE_FLAGS_OFF["no_repeat_words"], dest="no_repeat_words", action="store_const", const=False,
                       help="let content words repeat")
    p.add_argument("--detector-weight", type=float, metavar="W",
                   help="each content word's score gains W x log p(the photo shows it), p the model's word detector "
                        "(0 = off; default: the checkpoint's)")


def add_batch_size(p: argparse.ArgumentParser) -> None:
    """--batch-size, for the commands that caption many images (checked by `decode_overrides`)."""
    p.add_argument("--batch-size", type=int, default=32, help="images per batch (default 32)")


DECODE_FLAGS = {"beam_size": "--beam", "max_length": "--max-length", "length_penalty": "--length-penalty",
                "no_repeat_ngram": "--no-repeat-ngram", "no_repeat_words": "--no-repeat-words",
                "detector_weight": "--detector-weight"}
DECODE_FLAGS_OFF = {"no_repeat_words": "--repeat-words"}  # a switch's other flag


def decode_flags(decode: Any) -> list[str]:
    """The command-line flags that give a `DecodeConfig`'s settings (`add_decode_flags`' inverse)."""
    flags: list[str] = []
    for key, flag in DECODE_FLAGS.items():
        value = getattr(decode, key)
        if isinstance(value, bool):
            flags.append(flag if value else DECODE_FLAGS_OFF[key])
        else:
            flags += [flag, str(value)]
    return flags


def decode_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The decode options given, as DecodeConfig fields (None = the checkpoint's), checked now,
    before the model loads."""
    from captioner.config import ConfigError, DecodeConfig

    if getattr(args, "batch_size", 1) < 1:
        raise CaptionerError(f"--batch-size must be at least 1, got {args.batch_size}")
    given = {key: getattr(args, key) for key in DECODE_FLAGS}
    try:
        DecodeConfig(**{k: v for k, v in given.items() if v is not None})
    except ConfigError as e:
        message = str(e)
        for key, flag in DECODE_FLAGS.items():
            message = message.replace(f"config key 'decode.{key}'", flag)
        raise CaptionerError(message) from None
    return given


def check_range(flag: str, value: float, spec: str) -> None:
    """One line naming `flag` unless `value` lies within `spec`, in the config schema's notation and words
    ("[0, 10]", "(0, 1024]", ">= 1"; nan never does)."""
    from captioner.config.schema import allows

    if not allows(spec, value):
        raise CaptionerError(f"{flag}: {value!r} is not allowed (must be {spec})")


def refuse_empty_paths(named: list[tuple[str, str | None]]) -> None:
    """One line naming the first (argument, path) given as '' (an unset shell variable: "$IMG"), which would
    otherwise mean the current folder; None (not given) is fine."""
    for name, path in named:
        if path == "":
            raise CaptionerError(f"{name}: empty path (an unset shell variable?)")


def add_text(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--text", metavar="CAPTION",
                   help=f"no search: {what} these words (teacher-forced), each with its log-probability; "
                        f"every word must be in the model's vocabulary")


def word_logprobs(caption: Any) -> str:
    """A forced caption's words and <end>, each with its log-probability, and their sum:
    `a -0.05  red -1.20  circle -0.33  <end> -0.02  (sum -1.60)`."""
    end = caption.logprob - sum(caption.word_logprobs)
    pairs = [*zip(caption.tokens, caption.word_logprobs), ("<end>", end)]
    return "  ".join(f"{word} {lp:.2f}" for word, lp in pairs) + f"  (sum {caption.logprob:.2f})"


def add_runtime(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtime", choices=("torch", "onnx"), default="torch",
                   help="torch, or onnx: ONNX Runtime on the CPU (without torch), --checkpoint then an export folder "
                        "of `captioner export` or a checkpoint (exported once into the cache); needs pip install "
                        "'captioner[onnx]'")


def use_bundled_model(args: argparse.Namespace) -> None:
    """No --checkpoint: the model bundled with the package (an export folder, so --runtime onnx) fills
    args.checkpoint and args.runtime, for the command's messages too; a one-line error when the
    package holds none."""
    from captioner.deploy.folder import bundled_model

    folder = bundled_model()
    if folder is None:
        raise CaptionerError("no model given and none bundled with this installation: pass --checkpoint CKPT (a "
                             "checkpoint of `captioner train` or an export folder of `captioner export`)")
    args.checkpoint, args.runtime = [str(folder)], "onnx"


def load_captioner(args: argparse.Namespace, teacher_forcing: bool = False) -> Any:
    """The Captioner the command's --checkpoint (or the bundled model), --device and --runtime ask for.
    ONNX runs on ONNX Runtime and numpy alone (`deploy.lite`: no torch imported), unless the command
    needs the torch decoder interface (`teacher_forcing`: evaluate's reference captions), which drives
    the graphs from torch (`deploy.runtime`)."""
    if args.checkpoint is None:
        use_bundled_model(args)
    refuse_empty_paths([("--checkpoint", path) for path in args.checkpoint])
    if getattr(args, "runtime", "torch") == "onnx":
        if len(args.checkpoint) > 1:
            raise CaptionerError("--runtime onnx takes one model (an ensemble runs with --runtime torch)")
        if args.device not in ("auto", "cpu"):
            raise CaptionerError(f"--runtime onnx runs on the CPU, not --device {args.device}")
        if teacher_forcing:
            from captioner.deploy.runtime import onnx_captioner

            return onnx_captioner(args.checkpoint[0])
        from captioner.deploy.lite import lite_captioner

        return lite_captioner(args.checkpoint[0])
    refuse_export_folders(args.checkpoint)
    from captioner.decoding.captioner import Captioner

    return Captioner.from_checkpoint(args.checkpoint, args.device)


def refuse_export_folders(checkpoints: list[str]) -> None:
    """One line for an export folder given where the torch runtime wants checkpoint files."""
    from captioner.deploy import MANIFEST

    for path in checkpoints:
        if (Path(path) / MANIFEST).is_file():
            raise CaptionerError(f"{path}: an exported model folder (of `captioner export`), not a checkpoint: "
                                 f"run it with --runtime onnx")


def print_evaluation(metrics: dict[str, float], grounding: Any, meteor_note: str = "java not found",
                     diversity: dict[str, float] | None = None, focus: dict[str, float] | None = None,
                     hallucination: tuple[Any, Any] | None = None) -> None:
    """The metric table, the captions' diversity, object hallucination (CHAIR of the generated
    captions and of the references), how sharply the maps peak, and attention grounding when the
    data has boxes."""
    print(f"{'metric':<10}{'score':>8}")
    for name, value in metrics.items():
        print(f"{name:<10}{value:>8.4f}" if name != "CIDEr" else f"{'CIDEr-D':<10}{value:>8.4f}")
    if "METEOR" not in metrics and metrics:
        print(f"{'METEOR':<10}{'skipped':>8}  ({meteor_note})")
    if diversity:
        print(f"captions: {diversity['dangling']:.1%} end on a function word, {diversity['distinct_words']:.0f} "
              f"distinct words, {diversity['distinct_captions']:.0f} distinct captions")
    if hallucination is not None:
        print_hallucination(*hallucination)
    if focus:
        from captioner.decoding.metrics import FOCUSED

        print(f"attention: a word's peak weight is a median {focus['peak_median']:.1f}x an even spread (90th "
              f"percentile {focus['peak_p90']:.1f}x); {focus['focused']:.0%} of words peak above {FOCUSED:g}x")
    if grounding is not None:
        print_grounding(grounding, "generated captions")


def print_hallucination(generated: Any, references: Any, words: int = 6) -> None:
    """CHAIR (`Hallucination`s) of the generated captions beside the references' own."""
    if not generated.mentions:
        print(f"objects:  none of the {generated.captions} captions names one of COCO's 80 object kinds (no CHAIR)")
        return
    most = ", ".join(f"{w} {n}" for w, n in list(generated.by_word.items())[:words])
    print(f"objects:  {generated.chair_i:.1%} of {generated.mentions} object words name a kind no reference of the "
          f"photo names (CHAIR-i), in {generated.chair_s:.1%} of captions (CHAIR-s); the references, each against "
          f"the others: {references.chair_i:.1%} / {references.chair_s:.1%}{f'; most: {most}' if most else ''}")


def print_grounding(g: Any, what: str, words: int = 8) -> None:
    """The pointing game's table (a `GroundingResult`): hit rate and mass in the box beside their
    baselines, overall, by object size and for the most frequent words."""
    print(f"grounding ({what}): {g.words} words naming a boxed object; hit = the map's peak in the object's box, "
          f"mass = its weight inside; baselines: the photo's centre, an even map")
    print(f"  {'words':<22}{'n':>5}{'hit':>7}{'centre':>8}{'mass':>7}{'even':>7}")
    rows = [("all", g.all), ("objects < 25% of photo", g.small), ("objects >= 25%", g.large)]
    rows += [(f"  {w}", p) for w, p in list(g.by_word.items())[:words]]
    for name, p in rows:
        if p.words:
            print(f"  {name:<22}{p.words:>5}{p.hit_rate:>7.3f}{p.centre_hit_rate:>8.3f}{p.mean_mass:>7.3f}"
                  f"{p.even_mass:>7.3f}")
    if g.multi_captions:
        print(f"  captions naming 2+ boxed objects: {g.multi_captions}, each word on its own object from its own "
              f"cell: {g.multi_own_box:.3f}")
    print(f"  distinct peak cells per word of a caption: {g.distinct_peaks:.2f}")
