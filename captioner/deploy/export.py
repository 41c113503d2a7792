"""`captioner export --format onnx`: a checkpoint as three or four ONNX graphs and a manifest.

    encoder.onnx   pixels (B, 3, S, S) -> grid (B, L, D_enc)                          the CNN
    memory.onnx    grid (B, L, D_enc) -> features (B, L, D), keys (B, L, A), state (B, S_h)   once per image
    step.onnx      tokens (R,), state (R, S_h), features (R, L, D), keys (R, L, A)
                   -> logits (R, V), alpha (R, L), state (R, S_h)                      one word
    words.onnx     grid (B, L, D_enc) -> (B, V) log p(the photo shows each word)      the word detector,
                   for `decode.detector_weight` (only for a decoder that has one)
    manifest.json  vocabulary, decode defaults, grid and cell geometry, preprocessing, versions

memory and step are the decoder rewritten for inference (`captioner.deploy.step`: token tables; their
"keys" are the decoder's, 2·W1·features); step.onnx is compared with the training decoder's own step.

Every batch axis is dynamic. The project's beam search drives memory and step exactly as it drives
the torch decoder (`captioner.deploy.runtime`). Each graph is checked with the ONNX checker and
compared with torch on inputs of two batch sizes before the export counts as done.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import shutil
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from captioner.config import DecodeConfig
from captioner.deploy import EXPORT_VERSION, MANIFEST, OPSET, SMALL_WEIGHTS, WORDS, FormatError, require_onnx
from captioner.deploy.quantize import calibration_pixels, quantize_encoder, relative_difference
from captioner.deploy.step import InferenceMemory, InferenceStep, InferenceWords
from captioner.deploy.weights import round_weights, store_weights
from captioner.files import atomic_write_text, staged_files, writable_dir
from captioner.model.caption_model import CaptionModel
from captioner.model.checkpoint import load_checkpoint, restore_model
from captioner.model.decoder import AttentionDecoder
from captioner.model.memory import Memory

log = logging.getLogger(__name__)
TOLERANCE = 1e-4  # largest difference from torch accepted, on any output
HALF_TOLERANCE = 0.01  # largest relative difference of a float16 encoder's grids accepted (Lite0: 0.26%)


class _ReferenceWords(nn.Module):
    """The training decoder's own `word_log_probs`: what words.onnx must match."""

    def __init__(self, decoder: AttentionDecoder) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, grid: Tensor) -> Tensor:
        return self.decoder.word_log_probs(grid)


class _ReferenceStep(nn.Module):
    """The training decoder's own step, on the graphs' inputs: what step.onnx must match."""

    def __init__(self, decoder: AttentionDecoder) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, tokens: Tensor, state: Tensor, features: Tensor, keys: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        out = self.decoder.step(tokens, state, Memory(features, keys))
        return out.logits, out.alpha, out.hidden


@dataclass
class ExportReport:
    """What was written and how closely each graph matches torch (largest absolute difference); for
    an int8 or float16 encoder, its grids' relative difference from the float32 encoder's (int8: on
    the calibration photos)."""

    folder: Path
    files: list[Path]
    differences: dict[str, float]
    encoder_difference: float | None = None


def export_graph(module: nn.Module, inputs: tuple[Tensor, ...], names: list[str], outputs: list[str], path: Path) -> None:
    """`module(*inputs)` as one ONNX file at `path` (no external data), every input's axis 0 dynamic."""
    batch = torch.export.Dim("batch", min=1, max=4096)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's notes on its own internals
        program = torch.onnx.export(module.eval(), inputs, input_names=names, output_names=outputs,
                                    dynamic_shapes=tuple({0: batch} for _ in inputs), dynamo=True,
                                    opset_version=OPSET, verbose=False)
    program.save(str(path), external_data=False)


def compare_graph(path: Path, module: nn.Module, inputs: tuple[Tensor, ...], names: list[str]) -> float:
    """Check the graph (ONNX checker) and run it next to `module` (torch): the largest difference of
    any output."""
    import onnx
    import onnxruntime as ort

    onnx.checker.check_model(str(path), full_check=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {n: x.numpy() for n, x in zip(names, inputs)})
    with torch.no_grad():
        want = module(*inputs)
    want = want if isinstance(want, tuple) else (want,)
    return max(float(np.abs(g - w.numpy()).max()) for g, w in zip(got, want))


def manifest(ckpt: Any, model: CaptionModel, checkpoint: str, precision: dict[str, Any],
             decode: DecodeConfig | None = None) -> dict[str, Any]:
    """What the runtime needs besides the graphs, and the data settings `evaluate` scores it with;
    `decode`: the decode defaults it records (None = the checkpoint's)."""
    import onnx
    import onnxruntime

    enc = model.encoder
    return {
        "format": "captioner-onnx", "version": EXPORT_VERSION, "checkpoint": checkpoint,
        "encoder": {"name": enc.name, "image_size": enc.image_size, "interpolation": enc.interpolation.value,
                    "mean": list(enc.mean), "std": list(enc.std), "grid": list(enc.grid),
                    "cells": enc.cells._asdict(), "width": enc.out_dim, **precision},
        "data": dataclasses.asdict(ckpt.config.data),
        "vocabulary": ckpt.vocab.to_list(),
        "decode": dataclasses.asdict(decode or ckpt.config.decode),
        "meta": {k: ckpt.meta[k] for k in ("epoch", "step", "metrics") if k in ckpt.meta},
        "versions": {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__},
    }


def half_encoder(path: Path, pixels: np.ndarray) -> float:
    """Store the weights of the encoder graph at `path` in float16 (rounded; it still computes in
    float32): half the file. Returns its grids' relative difference from the float32 graph's on
    `pixels` (N, 3, S, S); raises FormatError above HALF_TOLERANCE."""
    fp32 = path.with_name(f"{path.stem}-float32.onnx")
    shutil.copyfile(path, fp32)
    try:
        store_weights(path, "float16", exact=False)
        difference = relative_difference(fp32, path, pixels)
    finally:
        fp32.unlink()
    if difference > HALF_TOLERANCE:
        raise FormatError(f"its float16 encoder differs from float32 by {difference:.1%} (more than "
                          f"{HALF_TOLERANCE:.0%}); export without --quantize")
    return difference


def export_verified(module: nn.Module, example: tuple[Tensor, ...], inputs: list[str], outputs: list[str],
                    path: Path, checks: Sequence[tuple[Tensor, ...]], reference: nn.Module | None = None,
                    prepare: Callable[[Path], None] | None = None, name: str | None = None) -> float:
    """Export `module` traced on `example` to `path`, then run the graph next to `reference` (default:
    `module`) on each of `checks`: the largest difference of any output. Above TOLERANCE the file is
    removed and FormatError names `name` (default: the path). `prepare` rewrites the file before the
    check (say, float16 weights). What `captioner export` and the cache's ONNX encoder both use."""
    export_graph(module, example, inputs, outputs, path)
    if prepare is not None:
        prepare(path)
    difference = max(compare_graph(path, reference or module, check, inputs) for check in checks)
    if difference > TOLERANCE:
        path.unlink(missing_ok=True)
        raise FormatError(f"{name or path}: differs from torch by {difference:.2e} (more than {TOLERANCE:g})")
    return difference


def _graphs(model: CaptionModel, dec: AttentionDecoder, memory: InferenceMemory, tables: bool) -> dict[str, tuple]:
    """name: (what is exported, what it must match, input names, output names); the word detector's
    graph only for a decoder that has one."""
    graphs = {"encoder": (model.encoder, model.encoder, ["pixels"], ["grid"]),  # (B, 3, S, S) -> (B, L, D_enc)
              "memory": (memory, memory, ["grid"], ["features", "keys", "state"]),
              "step": (InferenceStep(dec, tables=tables), _ReferenceStep(dec), ["tokens", "state", "features", "keys"],
                       ["logits", "alpha", "new_state"])}
    if dec.detects_words:
        graphs[WORDS] = (InferenceWords(dec), _ReferenceWords(dec), ["grid"], ["log_probs"])  # (B, V)
    return graphs


def _export_graphs(graphs: dict[str, tuple], traced: dict, checks: list[dict], stage: Path, out: Path,
                   small: str | None) -> dict[str, float]:
    """Export and verify each graph into `stage` (`export_verified`), the decoder's weights stored as
    `small` rounded them (None: float32); each one's largest difference."""
    store = functools.partial(store_weights, precision=small)
    differences = {}
    for name, (module, reference, inputs, outputs) in graphs.items():
        path = stage / f"{name}.onnx"
        log.info("exporting %s", out / path.name)
        differences[name] = export_verified(module, traced[name], inputs, outputs, path,
                                            [check[name] for check in checks], reference,
                                            store if small and name != "encoder" else None, str(out / path.name))
    return differences


def _shrink_encoder(encoder: Path, calibration: np.ndarray | None, half: np.ndarray | None
                    ) -> tuple[dict[str, Any], float | None]:
    """Make the verified float32 graph `encoder` int8, calibrated on `calibration` (N, 3, S, S), or
    store its weights in float16, checked on `half` pixels; in place. Its manifest fields and its
    grids' relative difference from float32 (None: left float32)."""
    if calibration is not None:
        log.info("quantizing the encoder to int8 on %d photos", len(calibration))
        quantized = encoder.with_name(f"{encoder.stem}-int8.onnx")
        difference = quantize_encoder(encoder, quantized, calibration)
        quantized.replace(encoder)
        return {"precision": "int8", "calibration": {"images": len(calibration),
                                                     "relative_difference": round(difference, 4)}}, difference
    if half is not None:
        difference = half_encoder(encoder, half)
        return {"encoder_weights": "float16", "relative_difference": round(difference, 5)}, difference
    return {}, None


def export_onnx(checkpoint: str | Path, out_dir: str | Path, seed: int = 0,
                int8_calibration: Sequence[str] | None = None, small: str | None = None,
                decode: Mapping[str, Any] | None = None, float16_encoder: bool = False) -> ExportReport:
    """Export `checkpoint` to `out_dir` (created; files replaced) and verify it. With
    `int8_calibration` (photo paths) the encoder is quantized to int8, calibrated on those photos
    (`captioner.deploy.quantize`); `float16_encoder`: its weights stored in float16 instead (half the
    file, grids within ~0.3% of float32). `small` ("float16" or "int8", `captioner.deploy.weights`): the
    decoder's weights rounded so and stored so, and no token tables in the step graph (float16: about a
    quarter of the size, int8 an eighth; the step a little slower).
    `decode`: DecodeConfig fields the export's decode defaults change (None values = the
    checkpoint's), e.g. {"beam_size": 5}: what `caption` and `serve` use with it. Raises
    FormatError (one line) for what cannot be exported, and when a graph differs from torch by more
    than TOLERANCE."""
    require_onnx()
    if int8_calibration is not None and float16_encoder:
        raise FormatError("the encoder is either int8 or float16, not both")
    if small is not None and small not in SMALL_WEIGHTS:
        raise FormatError(f"small {small!r}: the decoder's weights are stored in one of {', '.join(SMALL_WEIGHTS)}")
    out = writable_dir(out_dir)
    ckpt = load_checkpoint(checkpoint)
    if ckpt.model_config.decoder.init_pooling == "attention":
        raise FormatError(f"{checkpoint}: model.decoder.init_pooling 'attention' is not exported yet (use 'mean' "
                          f"or 'none')")
    defaults = ckpt.config.decode.with_overrides(**(decode or {}))
    model = restore_model(ckpt, checkpoint).eval()
    calibration = (None if int8_calibration is None else  # read before minutes of export, not after
                   calibration_pixels(int8_calibration, model.encoder.transform(train=False)))
    generator = torch.Generator().manual_seed(seed)
    S, dec = model.encoder.image_size, (round_weights(model.decoder, small) if small else model.decoder)

    def examples(batch: int) -> dict[str, tuple[Tensor, ...]]:
        pixels = torch.randn(batch, 3, S, S, generator=generator)
        with torch.no_grad():
            grid = model.encoder(pixels)
            features, keys, state = memory(grid)
            state = state + 0.1 * torch.randn(state.shape, generator=generator)  # not only the start state
        tokens = torch.randint(4, len(ckpt.vocab), (batch,), generator=generator)
        return {"encoder": (pixels,), "memory": (grid,), "step": (tokens, state, features, keys), WORDS: (grid,)}

    memory = InferenceMemory(dec)
    graphs = _graphs(model, dec, memory, tables=not small)
    traced, checks = examples(2), [examples(1), examples(5)]
    with staged_files(out, last=MANIFEST) as stage:  # a refused export leaves `out` as it was
        differences = _export_graphs(graphs, traced, checks, stage, out, small)
        precision: dict[str, Any] = {"precision": "float32", "decoder_weights": small or "float32"}
        half = checks[-1]["encoder"][0].numpy() if float16_encoder else None
        try:
            shrunk, encoder_difference = _shrink_encoder(stage / "encoder.onnx", calibration, half)
        except FormatError as e:
            raise FormatError(f"{checkpoint}: {e}") from None
        record = manifest(ckpt, model, str(checkpoint), {**precision, **shrunk}, defaults)
        atomic_write_text(stage / MANIFEST, json.dumps(record, indent=1))
    if WORDS not in graphs:  # an earlier export's word detector into `out` is not this model's
        (out / f"{WORDS}.onnx").unlink(missing_ok=True)
    files = [out / f"{name}.onnx" for name in graphs] + [out / MANIFEST]
    return ExportReport(out, files, differences, encoder_difference)
