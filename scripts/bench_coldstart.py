"""Time to the first caption (and picture): a whole `captioner caption PHOTO` process, from start to exit,
three ways, and a whole `captioner visualize PHOTO` with the torch-free runtime.

    python scripts/bench_coldstart.py --export EXPORT_DIR [--checkpoint CKPT] [--photo PHOTO] [--runs 7]

    torch-free onnx    `captioner caption PHOTO --runtime onnx --checkpoint EXPORT_DIR`: ONNX Runtime,
                       numpy and Pillow (`captioner.deploy.lite`), what the bundled model runs
    torch-driven onnx  the same command with the torch beam search over the same graphs
                       (`deploy.runtime.onnx_captioner`, what `--runtime onnx` ran before): torch too
    torch              `captioner caption PHOTO --checkpoint CKPT --device cpu`: the checkpoint in torch
    visualize onnx     `captioner visualize PHOTO --runtime onnx --checkpoint EXPORT_DIR -o PNG`: the
                       caption and its picture of every word's map (matplotlib), torch-free too

Each run is a new Python process (the file cache is warm: one uncounted run of each first); the
commands run in turn, so drift on a shared machine spreads over all three. Printed: min / median /
max wall seconds of each, its median CPU seconds (user + system: on a busy machine the wall time
waits for a core, the CPU time does not) and peak memory; then where each spends its imports
(`python -X importtime`: the top-level imports by cumulative time, the captioner's own lazy imports
included). Without --export, the bundled model (captioner/models/flickr8k) is timed. Threads:
OMP_NUM_THREADS as given (the encoder's, for both runtimes).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared/data/flickr8k-800/Images"
# The CLI with `captioner.deploy.lite.lite_captioner` swapped for the torch-driven runtime: the same
# command, parsing and printing, only the runtime differs.
TORCH_DRIVEN = ("import sys\n"
                "import captioner.deploy.lite as lite\n"
                "from captioner.deploy.runtime import onnx_captioner\n"
                "lite.lite_captioner = onnx_captioner\n"
                "from captioner.cli import main\n"
                "sys.exit(main(sys.argv[1:]))")
CLI = "import sys\nfrom captioner.cli import main\nsys.exit(main(sys.argv[1:]))"


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--export", help="an export folder of `captioner export` (default: the bundled model)")
    p.add_argument("--checkpoint", help="a checkpoint for the torch row (left out: no torch row)")
    p.add_argument("--photo", default=str(min(DATA.glob("*.jpg"), default="")), help="the photo to caption")
    p.add_argument("--runs", type=int, default=7, help="timed runs of each command")
    p.add_argument("--top", type=int, default=6, help="imports shown per command")
    return p


def commands(args: argparse.Namespace, export: str, picture: str) -> dict[str, list[str]]:
    """The timed commands by row name; `picture`: where `visualize` writes its PNG."""
    python = [sys.executable, "-c"]
    onnx = ["caption", args.photo, "--runtime", "onnx", "--checkpoint", export]
    rows = {"torch-free onnx": [*python, CLI, *onnx], "torch-driven onnx": [*python, TORCH_DRIVEN, *onnx],
            "visualize onnx": [*python, CLI, "visualize", args.photo, "--runtime", "onnx", "--checkpoint", export,
                               "-o", picture]}
    if args.checkpoint:
        rows["torch"] = [*python, CLI, "caption", args.photo, "--checkpoint", args.checkpoint, "--device", "cpu"]
    return rows


class Run(NamedTuple):
    wall: float  # seconds, start to exit
    cpu: float  # user + system seconds of the process: what a busy machine does not inflate
    peak_mib: float  # its largest resident set
    stderr: str


def run_once(command: list[str], importtime: bool = False) -> Run:
    """One whole process, measured from outside; a failed run stops the benchmark."""
    if importtime:
        command = [command[0], "-X", "importtime", *command[1:]]
    with tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        stderr = err.read()
    if process.returncode != 0:
        sys.exit(f"{' '.join(command[3:])}: exit {process.returncode}\n{stderr[-2000:]}")
    return Run(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, stderr)


def top_imports(stderr: str, n: int) -> list[tuple[str, float]]:
    """The top-level imports (those no other import pulled in) by cumulative seconds."""
    found = []
    for line in stderr.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)  # no indent: a top-level import
        if m:
            found.append((m.group(2), int(m.group(1)) / 1e6))
    return sorted(found, key=lambda x: -x[1])[:n]


def main(args: argparse.Namespace) -> None:
    export = args.export
    if export is None:
        from captioner.deploy.folder import bundled_model

        export = str(bundled_model() or sys.exit("no --export given and no model bundled with the package"))
    if not Path(args.photo).is_file():
        sys.exit(f"--photo {args.photo!r}: no such file")
    picture = tempfile.TemporaryDirectory()
    rows = commands(args, export, str(Path(picture.name) / "maps.png"))
    for command in rows.values():  # warm the file cache; not counted
        run_once(command)
    runs: dict[str, list[Run]] = {name: [] for name in rows}
    for _ in range(args.runs):
        for name, command in rows.items():
            runs[name].append(run_once(command))
    print(f"photo {args.photo}\nexport {export}  checkpoint {args.checkpoint or '-'}  "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}  {args.runs} runs each, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
    print(f"{'whole process':<20}{'wall s: min':>12}{'median':>8}{'max':>8}{'cpu s':>8}{'peak MiB':>10}")
    for name, measured in runs.items():
        wall = [r.wall for r in measured]
        cpu, peak = statistics.median(r.cpu for r in measured), statistics.median(r.peak_mib for r in measured)
        print(f"{name:<20}{min(wall):>12.3f}{statistics.median(wall):>8.3f}{max(wall):>8.3f}{cpu:>8.3f}{peak:>10.0f}")
    for name, command in rows.items():
        print(f"\n{name}: top-level imports (cumulative s, python -X importtime)")
        for module, seconds in top_imports(run_once(command, importtime=True).stderr, args.top):
            print(f"  {module:<40}{seconds:>7.3f}")


if __name__ == "__main__":
    main(get_args_parser().parse_args())
