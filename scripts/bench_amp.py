"""Float32 against bf16 autocast on the CPU, measured on real training: `captioner train` run as a
user runs it, for the same number of optimiser steps in each precision, the two alternating.

    python scripts/bench_amp.py                                              # flickr8k-800, 200 steps each
    python scripts/bench_amp.py --config flickr8k --data ../shared/data/flickr8k --steps 300
    python scripts/bench_amp.py --config flickr8k-scst --init runs/flickr8k/xent/best.pt \\
        --data ../shared/data/flickr8k --steps 160                            # the SCST stage

Each run is its own process, so nothing carries over from one to the next (oneDNN's kernels, the
heap); it trains from the feature cache (built first, outside the timing, or the one its --init
checkpoint was trained from) and validates on a few
images at its end. Printed per run: training seconds and captions/s (from its metrics.jsonl,
validation excluded) and the process's peak RSS; then bf16 over float32, from the means.

Why whole runs and not repeated batches: bf16 on the CPU goes through oneDNN, which compiles a kernel
for every new shape and keeps the last 1,024. Training keeps meeting new shapes (caption lengths,
packed steps, beams): a benchmark that times the same batches again measures that cache warm, and
neither its compile time nor its memory.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

CAPTIONER = [sys.executable, "-m", "captioner.cli"]
ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("off", "bf16")  # train.amp values: float32, bf16 autocast


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="flickr8k-800", help="a config name or file (default: flickr8k-800)")
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "flickr8k-800"))
    p.add_argument("--init", default="", help="checkpoint to start from (an SCST config needs one)")
    p.add_argument("--steps", type=int, default=200, help="optimiser steps per run")
    p.add_argument("--repeats", type=int, default=1, help="runs of each precision, alternating")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="for every run")
    return p


def run(command: list[str], log: Path) -> tuple[int, float]:
    """Run `command`, its output into `log`: (exit status, its peak RSS in GiB)."""
    with log.open("w") as f:
        child = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    return child.returncode, usage.ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def main(argv: list[str] | None = None) -> int:
    args = get_args_parser().parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        sys.exit("--steps and --repeats must be at least 1")
    common = ["--config", args.config, "--data", args.data, *(["--init", args.init] if args.init else [])]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not args.init:  # (an --init run reads the cache its checkpoint was trained from)
            code, _ = run([*CAPTIONER, "prepare", "--config", args.config, "--data", args.data, *args.overrides],
                          tmp / "prepare.log")
            if code:
                sys.exit(f"captioner prepare failed (exit {code}):\n{(tmp / 'prepare.log').read_text()[-2000:]}")
        rows: list[tuple[str, float, float, float]] = []  # (precision, seconds, captions/s, peak RSS GiB)
        print(f"{'run':14s} {'seconds':>8s} {'captions/s':>11s} {'peak RSS GiB':>13s}", flush=True)
        for r in range(args.repeats):
            for amp in PRECISIONS:
                out = tmp / f"{amp}-{r}"
                code, rss = run([*CAPTIONER, "train", *common, "--out", str(out), "--overwrite", *args.overrides,
                                 f"train.max_steps={args.steps}", "train.val_images=8", f"train.amp={amp}"],
                                tmp / f"{amp}-{r}.log")
                if code:
                    sys.exit(f"train.amp={amp} failed (exit {code}):\n{(tmp / f'{amp}-{r}.log').read_text()[-2000:]}")
                last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
                rows.append((amp, last["seconds"], last["captions_per_s"], rss))
                name = "float32" if amp == "off" else "bf16 autocast"
                print(f"{name:14s} {last['seconds']:8.1f} {last['captions_per_s']:11.1f} {rss:13.2f}", flush=True)
    f32, bf16 = ([row for row in rows if row[0] == amp] for amp in PRECISIONS)
    speed = mean(r[2] for r in bf16) / mean(r[2] for r in f32)
    extra = mean(r[3] for r in bf16) - mean(r[3] for r in f32)
    print(f"bf16 autocast / float32: {speed:.2f}x the captions/s, {extra:+.2f} GiB peak RSS "
          f"({args.steps} steps a run, {args.repeats} run(s) each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
