"""The whole Flickr8k recipe, end to end, as a user runs it: feature cache, cross-entropy training,
self-critical fine-tuning, then both models scored on the official dev list (caption metrics and
the pointing game on the hand-boxed dev photos), with each stage's wall time and peak memory.

    python scripts/flickr8k.py --data ../shared/data/flickr8k --out runs/flickr8k-recipe

Each stage is the `captioner` command a user would type, run as its own process; a stage whose
output already exists is skipped (so a second run only re-scores), unless --fresh. Both models are
scored, and the better one bundled, with the decode settings of its own config as it is now (a run
trained before they changed is scored as the recipe decodes today). Prints one
table: BLEU-1..4, METEOR, ROUGE-L, CIDEr-D, distinct words, objects hallucinated (CHAIR), grounding
hit rate and mass (with the centre-point and even-map baselines) and minutes, for the cross-entropy
and the SCST model.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from captioner.cli.common import decode_flags
from captioner.config import load_config
from captioner.data.sources import read_source
from captioner.deploy import CALIBRATION_IMAGES

CAPTIONER = [sys.executable, "-m", "captioner.cli"]


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="../shared/data/flickr8k",
                   help="the Flickr8k folder (Flickr8k.token.txt, Images/)")
    p.add_argument("--out", default="runs/flickr8k-recipe", help="folder for both runs and the reports")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (OMP_NUM_THREADS)")
    p.add_argument("--config", default="flickr8k", help="the cross-entropy config")
    p.add_argument("--scst-config", default="flickr8k-scst", help="the self-critical config ('' = skip SCST)")
    p.add_argument("--fresh", action="store_true", help="delete --out first and run every stage")
    p.add_argument("--bundle", metavar="DIR",
                   help="also export the model with the higher dev CIDEr-D as an ONNX folder (the encoder in int8, "
                        "calibrated on 64 training photos; the decoder's weights in int8 but the GRU's in float16) with "
                        "its model card "
                        "(captioner/models/flickr8k is the one `captioner caption` uses with no --checkpoint)")
    p.add_argument("overrides", nargs="*", help="section.key=value for the cross-entropy run")
    return p


def stage(name: str, command: list[str], env: dict[str, str], log: Path, shown: str = "") -> float:
    """Run one command, its output into `log`; returns its wall time in seconds (exits on failure).
    `shown`: what to print for the command (default: the command itself)."""
    print(f"{name}: {shown or ' '.join(command[2:])}", flush=True)
    tick = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.call(command, stdout=f, stderr=subprocess.STDOUT, env=env)
    seconds = time.perf_counter() - tick
    if code != 0:
        sys.exit(f"{name} failed (exit {code}); see {log}")
    print(f"{name}: {seconds / 60:.1f} min", flush=True)
    return seconds


def row(report: dict) -> dict[str, float]:
    m, g = report["metrics"], report.get("grounding") or {}
    out = {k: m.get(k, float("nan")) for k in ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr")}
    out["words"] = report["diversity"]["distinct_words"]
    out["beam"] = report["decode"]["beam_size"]
    chair = (report.get("hallucination") or {}).get("generated", {})
    out.update(chair_i=chair.get("chair_i", float("nan")), chair_s=chair.get("chair_s", float("nan")))
    every = g.get("all", {})
    out.update(hit=every.get("hit_rate", float("nan")), centre=every.get("centre_hit_rate", float("nan")),
               mass=every.get("mean_mass", float("nan")), even=every.get("even_mass", float("nan")))
    return out


def training_commands(args: argparse.Namespace, xent: Path, scst: Path) -> dict[str, list[str]]:
    """The `captioner` arguments of the training stages: the feature cache (`prepare`, with the
    cross-entropy run's overrides, so it fills the cache that run reads), cross-entropy, SCST."""
    data = str(args.data)
    return {"cache": ["prepare", "--config", args.config, "--data", data, *args.overrides],
            "xent": ["train", "--config", args.config, "--data", data, "--out", str(xent), "--overwrite",
                     *args.overrides],
            "scst": ["train", "--config", args.scst_config, "--init", str(xent / "best.pt"), "--data", data,
                     "--out", str(scst), "--overwrite"]}


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    out, data = Path(args.out), Path(args.data)
    if args.fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    xent, scst = out / "xent", out / "scst"
    minutes: dict[str, float] = {}
    commands = training_commands(args, xent, scst)
    if not (xent / "best.pt").exists():
        minutes["cache"] = stage("cache", CAPTIONER + commands["cache"], env, out / "prepare.log") / 60
        minutes["xent"] = stage("cross-entropy", CAPTIONER + commands["xent"], env, out / "xent.log") / 60
    if args.scst_config and not (scst / "best.pt").exists():
        minutes["scst"] = stage("scst", CAPTIONER + commands["scst"], env, out / "scst.log") / 60
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux
    decodings = stage_decodings(args, xent)
    runs = {"cross-entropy": xent, "SCST": scst}
    rows = {}
    for name, run in runs.items():
        if not (run / "best.pt").exists():
            continue
        report = out / f"dev-{run.name}.json"
        stage(f"evaluate {name}", CAPTIONER + ["evaluate", "--checkpoint", str(run / "best.pt"), "--split", "val",
                                                "--data", str(data), "--boxes", str(data / "boxes-dev.jsonl"),
                                                "--out", str(report), *decodings[name]], env,
              out / f"evaluate-{run.name}.log")
        rows[name] = row(json.loads(report.read_text()))
    print_table(rows, minutes, peak_gib)
    if args.bundle and rows:
        best = max(rows, key=lambda name: rows[name]["CIDEr"])
        folder = Path(args.bundle)
        photos = calibration_photos(data)
        export = bundle_command(runs[best] / "best.pt", folder, decodings[best], photos)
        stage("bundle", CAPTIONER + export, env, out / "bundle.log",
              shown=" ".join(export[: len(export) - len(photos)] + [f"({len(photos)} training photos)"]))
        manifest = json.loads((folder / "manifest.json").read_text())
        write_card(folder / "MODEL_CARD.md", best, rows, minutes, args, manifest)
        size = sum(f.stat().st_size for f in folder.iterdir()) / 2**20
        print(f"bundled the {best} model: {folder} ({size:.1f} MB)")
    return 0


def stage_decodings(args: argparse.Namespace, xent: Path) -> dict[str, list[str]]:
    """The decode flags each stage's model is scored (and bundled) with: its own config's decode settings
    as they are now (a run trained before they changed is scored as the recipe decodes today). `xent`:
    the cross-entropy run's folder, which the SCST config fine-tunes."""
    decodes = {"cross-entropy": load_config(args.config).decode}
    decodes["SCST"] = load_config(args.scst_config, [f"train.init={xent / 'best.pt'}"]).decode \
        if args.scst_config else decodes["cross-entropy"]
    return {name: decode_flags(decode) for name, decode in decodes.items()}


def bundle_command(checkpoint: Path, folder: Path, decoding: list[str], photos: list[str]) -> list[str]:
    """The `captioner export` arguments of the bundle: the encoder in int8, calibrated on `photos`; the
    decoder's matrices in int8 (the GRU's in float16); the recipe's decoding as the export's defaults."""
    return ["export", "--checkpoint", str(checkpoint), "-o", str(folder), "--small", "int8", "--quantize", "int8",
            *decoding, "--calibration", *photos]


def calibration_photos(data: Path, n: int = CALIBRATION_IMAGES) -> list[str]:
    """`n` training photos, evenly spaced over the train split, for the int8 encoder's ranges (never a
    validation or test photo); the most `export --calibration` reads, so the command line stays short."""
    train = [str(r.image) for r in read_source(data) if r.split == "train"]
    return train[:: max(1, len(train) // n)][:n]


def stored_as(encoder: dict) -> str:
    """How a manifest's encoder is stored, for the model card."""
    if encoder.get("precision") == "int8":
        return ("the encoder in int8 (ONNX Runtime static quantization, calibrated on "
                f"{encoder['calibration']['images']} training photos)")
    if encoder.get("encoder_weights") == "float16":
        return (f"the encoder's weights in float16 (computed in float32; its grids within "
                f"{encoder['relative_difference']:.1%} of the trained model's)")
    return "the encoder in float32"


def decoder_stored_as(encoder: dict) -> str:
    """How a manifest's decoder weights are stored, for the model card."""
    weights = encoder.get("decoder_weights", "float32")
    if weights == "int8":
        return ("the decoder's weight matrices in int8 (one float32 scale per row), the GRU's in float16, all "
                "computed in float32")
    return f"the decoder's weights in {weights}"


def write_card(path: Path, which: str, rows: dict[str, dict[str, float]], minutes: dict[str, float],
               args: argparse.Namespace, manifest: dict) -> None:
    """The model card beside a bundled model: what it is, its data and licence, recipe, scores.
    `manifest`: the export's (its encoder: name, input size, grid; its decode defaults)."""
    encoder, decode = manifest["encoder"], manifest["decode"]
    rules = ", ".join(([f"no repeated {decode['no_repeat_ngram']}-gram"] if decode.get("no_repeat_ngram") else [])
                      + (["no content word twice"] if decode.get("no_repeat_words") else [])
                      + ([f"the word detector weighed in at {decode['detector_weight']:g}"]
                         if decode.get("detector_weight") else []))
    height, width = encoder["grid"]
    table = "\n".join(
        f"| {name} | {v['beam']:.0f} | {v['Bleu_1']:.3f} | {v['Bleu_4']:.3f} | {v['METEOR']:.3f} | {v['ROUGE_L']:.3f} | {v['CIDEr']:.3f} "
        f"| {v['words']:.0f} | {v['chair_i']:.1%} / {v['chair_s']:.1%} | {v['hit']:.3f} ({v['centre']:.3f}) "
        f"| {v['mass']:.3f} ({v['even']:.3f}) |"
        for name, v in rows.items())
    spent = ", ".join(f"{k} {v:.1f} min" for k, v in minutes.items()) or "stages reused from an earlier run"
    recipe = (f"`configs/{args.config}.yaml`, then `configs/{args.scst_config}.yaml` self-critical fine-tuning from "
              f"its best checkpoint" if args.scst_config else f"`configs/{args.config}.yaml`, cross-entropy only "
              f"(`--scst-config ''`)")
    path.write_text(f"""# Model card: captioner Flickr8k ({which})

**What it is.** An image captioner with Bahdanau attention: a frozen {encoder["name"]} (ImageNet
weights) at {encoder["image_size"]} px turns a photo into a {height}x{width} grid of regions; a GRU
decoder writes the caption word by word, attending over the regions at every step. Exported to ONNX
with {stored_as(encoder)}
and {decoder_stored_as(encoder)}, so `captioner caption photo.jpg` runs it with ONNX Runtime,
numpy and Pillow alone.

**Data.** Flickr8k (Hodosh, Young, Hockenmaier 2013; photos from Flickr, **for research use
only**): trained on the official train list (5,856 photos here, 5 captions each), validated on the
official dev list (970 photos). English captions, mostly of people and dogs outdoors: expect it to
describe those well and anything else (indoor scenes, objects, text) poorly, and to repeat the
biases of its captions (it says "man" and "woman" from appearance). Not for decisions about people.

**Recipe.** `python scripts/flickr8k.py --data PATH/flickr8k --bundle DIR{"".join(" " + o for o in args.overrides)}`:
{recipe}, on a 2-core CPU: {spent}.

**Scores on the Flickr8k dev list** (970 photos, each model with its config's beam, {rules}; objects
hallucinated: CHAIR-i / CHAIR-s, the share of the object words (COCO's 80 kinds) that no reference
of the photo names, and of the captions holding one (the references, each against the other four:
2.8% / 3.4%); grounding: the pointing game over the words
that name a hand-boxed object of 140 dev photos, with the photo-centre and even-map baselines in
brackets). The bundled model is the **{which}** row, as trained (in torch; the export's own scores
are `captioner evaluate --runtime onnx --checkpoint DIR`).

| model | beam | BLEU-1 | BLEU-4 | METEOR | ROUGE-L | CIDEr-D | distinct words | objects hallucinated | hit (centre) | mass in box (even) |
|---|---|---|---|---|---|---|---|---|---|---|
{table}

Published Show, Attend and Tell on the Flickr8k **test** list (not the same photos): soft attention
BLEU-1/4 0.67/0.195, METEOR 0.189; hard attention 0.67/0.213, METEOR 0.203.
""")


def print_table(rows: dict[str, dict[str, float]], minutes: dict[str, float], peak_gib: float) -> None:
    print("\nFlickr8k dev (970 photos; grounding over the object words of the hand-boxed dev photos)")
    head = ["beam", "B-1", "B-2", "B-3", "B-4", "METEOR", "ROUGE-L", "CIDEr-D", "words", "CHAIR-i", "CHAIR-s", "hit",
            "centre", "mass", "even"]
    print(f"{'model':<15}" + "".join(f"{h:>9}" for h in head))
    for name, r in rows.items():
        values = [r["Bleu_1"], r["Bleu_2"], r["Bleu_3"], r["Bleu_4"], r["METEOR"], r["ROUGE_L"], r["CIDEr"]]
        cells = [f"{r['beam']:>9.0f}"] + [f"{v:>9.3f}" for v in values] + [f"{r['words']:>9.0f}"]
        cells += [f"{r[k]:>9.1%}" for k in ("chair_i", "chair_s")]
        cells += [f"{r[k]:>9.3f}" for k in ("hit", "centre", "mass", "even")]
        print(f"{name:<15}" + "".join(cells))
    if minutes:
        spent = ", ".join(f"{k} {v:.1f}" for k, v in minutes.items())
        print(f"minutes: {spent}; total {sum(minutes.values()):.1f}; peak RSS of a stage {peak_gib:.2f} GiB")


if __name__ == "__main__":
    sys.exit(main())
