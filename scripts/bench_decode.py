"""Captioning speed: torch against ONNX Runtime, batch 1 against 32, one thread against all, end
to end and per stage.

    python scripts/bench_decode.py [--checkpoint CKPT] [--data ../shared/data/flickr8k-800]
                                   [--images 64] [--beam 5] [--batch-size 32]

Same model, same images, in one run. "end to end" captions image files: JPEG decoding and
preprocessing (on the Captioner's loader threads, overlapped with the model), encoder, beam search.
The stage rows time each part alone: decoding the JPEGs (draft mode at the encoder's side),
preprocessing (one resize + normalisation), the encoder on preprocessed pixels, the beam search on
precomputed grids. "1 image from file" is the latency of one `caption([path])` call (median of 10).
Each measurement is the best of --repeats interleaved runs (other processes only ever add time).
Without --checkpoint an UNTRAINED model is used (the default encoder with its ImageNet weights, a
random decoder): nonsense captions that run to max_length more often, so a worst case.
Targets (one thread, beam 5): end to end at least 42 images/s; one image from file in 30 ms.
`onnx-int8` rows: the same export with its encoder quantized to int8 (captions change a little:
score it with `captioner evaluate --runtime onnx`).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from captioner.config import Config, DecodeConfig, ModelConfig
from captioner.data.images import load_image
from captioner.data.sources import read_source
from captioner.data.vocab import build_vocabulary
from captioner.decoding.captioner import Captioner
from captioner.decoding.search import decode
from captioner.model import build_model
from captioner.model.checkpoint import save_checkpoint
from captioner.device import seed_everything


def get_args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", help="a trained checkpoint; default: an untrained model (see above)")
    p.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared/data/flickr8k-800"),
                   help="data set whose images are captioned")
    p.add_argument("--images", type=int, default=64, help="images per measurement")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--max-length", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--threads", type=int, nargs="+", default=[1, torch.get_num_threads()],
                   help="thread counts to compare (default: 1 and all)")
    p.add_argument("--runtimes", nargs="+", default=["torch", "onnx", "onnx-int8"], choices=["torch", "onnx", "onnx-int8"],
                   help="onnx-int8: the export with the encoder in int8 (`captioner export --quantize int8`), "
                        "calibrated on 64 photos of --data that are not measured")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of each measurement; the best counts")
    return p


def untrained_checkpoint(records, folder: Path) -> tuple[Path, str]:
    vocab = build_vocabulary(c for r in records for c in r.captions)
    cfg = ModelConfig()
    model = build_model(cfg, len(vocab), pretrained=True)
    what = (f"UNTRAINED model: {cfg.encoder.name} encoder (ImageNet weights) at {cfg.encoder.image_size} px, "
            f"random decoder (H={cfg.decoder.hidden_dim}), vocabulary of {len(vocab)} words")
    return save_checkpoint(folder / "untrained.pt", Config(model=cfg), vocab, model.state_dict()), what


def load(runtime: str, source: Path, threads: int, decode_cfg: DecodeConfig) -> Captioner:
    """`source`: a checkpoint, or for onnx-int8 its int8 export folder."""
    torch.set_num_threads(threads)
    if runtime.startswith("onnx"):
        from captioner.deploy.runtime import onnx_captioner

        return onnx_captioner(source, decode_cfg, threads=threads)
    return Captioner.from_checkpoint(source, "cpu", decode_cfg)


def measurements(c: Captioner, paths: list[str], bs: int) -> dict[str, tuple[Callable[[], object], ...]]:
    """name -> (batch 1, batch bs) workloads over the same images."""
    n = len(paths)
    images = [load_image(p, draft=c.image_side) for p in paths]
    pixels = [c.preprocess(im) for im in images]
    with torch.inference_mode():
        grids = torch.cat([c.model.encoder.infer(torch.stack(pixels[i : i + bs])) for i in range(0, n, bs)])

    def encoder(size: int) -> None:
        with torch.inference_mode():
            for i in range(0, n, size):
                c.model.encoder.infer(torch.stack(pixels[i : i + size]))

    def search(size: int) -> None:
        with torch.inference_mode():
            for i in range(0, n, size):
                decode(c.model.decoder, grids[i : i + size], c.decode, c.vocab)

    return {
        "end to end, from files": (lambda: c.caption(paths, batch_size=1), lambda: c.caption(paths, batch_size=bs)),
        "  decode JPEG (draft)": (lambda: [load_image(p, draft=c.image_side) for p in paths],),
        "  preprocess": (lambda: [c.preprocess(im) for im in images],),
        "  encoder": (lambda: encoder(1), lambda: encoder(bs)),
        "  beam search": (lambda: search(1), lambda: search(bs)),
    }


def main(args) -> None:
    seed_everything(0)
    records = read_source(args.data)
    paths = [str(r.image) for r in records][: args.images]
    decode_cfg = DecodeConfig(beam_size=args.beam, max_length=args.max_length)
    n, bs = len(paths), args.batch_size
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint, what = ((Path(args.checkpoint), f"checkpoint {args.checkpoint}") if args.checkpoint
                            else untrained_checkpoint(records, Path(tmp)))
        print(f"model:   {what}")
        sources = {runtime: checkpoint for runtime in args.runtimes}
        if "onnx-int8" in args.runtimes:
            from captioner.deploy import CALIBRATION_IMAGES
            from captioner.deploy.export import export_onnx

            calibration = [str(r.image) for r in records][n : n + CALIBRATION_IMAGES]
            report = export_onnx(checkpoint, Path(tmp) / "int8", int8_calibration=calibration)
            sources["onnx-int8"] = report.folder
            print(f"int8:    encoder calibrated on {len(calibration)} other photos; its grids differ from float32 "
                  f"by {report.encoder_difference:.1%}")
        print(f"data:    {n} images from {args.data}; beam {args.beam}, max length {args.max_length}; "
              f"best of {args.repeats}")
        rows: list[tuple[str, int, str, list[float]]] = []
        for runtime in args.runtimes:
            for threads in args.threads:
                c = load(runtime, sources[runtime], threads, decode_cfg)
                c.caption(paths[:2], batch_size=2)  # warm-up (allocators, lazy init, sessions)
                runs = measurements(c, paths, bs)
                best = {name: [float("inf")] * len(fns) for name, fns in runs.items()}
                for _ in range(args.repeats):
                    for name, fns in runs.items():
                        for j, fn in enumerate(fns):
                            tick = time.perf_counter()
                            fn()
                            best[name][j] = min(best[name][j], time.perf_counter() - tick)
                rows += [(runtime, threads, name, [n / t for t in times]) for name, times in best.items()]
                latencies = []
                for p in paths[:10]:
                    tick = time.perf_counter()
                    c.caption([p], batch_size=1)
                    latencies.append(time.perf_counter() - tick)
                rows.append((runtime, threads, "1 image from file (ms)", [1000 * statistics.median(latencies)]))
    print()
    print(f"{'runtime':<10}{'threads':>8}  {'measurement (images/s)':<28}{'batch 1':>10}{f'batch {bs}':>10}")
    for runtime, threads, name, values in rows:
        cells = "".join(f"{v:>10.1f}" for v in values)
        print(f"{runtime:<10}{threads:>8}  {name:<28}{cells}")
    by = {(r, t, name): v for r, t, name, v in rows}
    if "torch" in args.runtimes:
        print()
        for runtime in (r for r in args.runtimes if r != "torch"):
            for threads in args.threads:
                e2e = [by[(runtime, threads, "end to end, from files")][j]
                       / by[("torch", threads, "end to end, from files")][j] for j in range(2)]
                print(f"{runtime} / torch, {threads} thread(s), end to end: batch 1 {e2e[0]:.2f}x, "
                      f"batch {bs} {e2e[1]:.2f}x")


if __name__ == "__main__":
    main(get_args_parser().parse_args())
