"""An int8 encoder for `captioner export --quantize int8`: static post-training quantization.

The exported float32 encoder.onnx is quantized with ONNX Runtime's own tools
(`onnxruntime.quantization.quantize_static`): weights int8 per output channel, activations uint8
with ranges calibrated (min/max) on a few dozen of the user's photos, in QDQ form, which ONNX
Runtime fuses into integer convolutions (VNNI where the CPU has it). The decoder's graphs stay
float32: they are a few small matrix products a word, and the maps must stay exact.

EfficientNet-Lite was designed for this (ReLU6, no squeeze-excite): on this CPU its int8 encoder
runs 2.2-2.3x faster at batch 1; its grids differ from float32 by 8-19% (relative, on photos; `FLOAT_CONVS`),
which changes some captions; `captioner evaluate --runtime onnx` on the export says by how much.
"""
from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from torch import Tensor

from captioner.data.images import load_image
from captioner.deploy import CALIBRATION_IMAGES, FormatError
from captioner.errors import CaptionerError

log = logging.getLogger(__name__)
INT8_TOLERANCE = 0.5  # largest relative difference of the int8 grids from float32 accepted (Lite0 measures ~0.18)
# The first convolutions (the stem and the first blocks, at 1/2 to 1/4 of the photo's side; at most an eighth of
# a net's: Lite2 has 64) stay float32. They hold few weights, but in int8 they make half the grids' error (Lite2, on
# the calibration photos: 0.081 with the first 8 float against 0.139 all int8, 0.100 / 0.075 with 2 / 16; 0.02 MB and
# ~1 ms a photo more). The word detector (`decode.detector_weight`) sums over every region and needs the closer
# grids: the bundled model's dev CIDEr-D with it 0.592 on the all-int8 encoder, 0.598 on this one, 0.603 in float32
FLOAT_CONVS = 8


def calibration_pixels(paths: Sequence[str], transform: Callable[[PIL.Image.Image], Tensor],
                       count: int = CALIBRATION_IMAGES) -> np.ndarray:
    """Up to `count` of `paths` (evenly spaced), decoded and preprocessed as captioning does:
    (N, 3, S, S) float32. Unreadable images are skipped with a warning; none readable is an error."""
    if not paths:
        raise FormatError("int8 calibration needs at least one photo (--calibration)")
    chosen = [paths[round(i * len(paths) / count)] for i in range(count)] if len(paths) > count else list(paths)
    pixels, skipped = [], 0
    for path in chosen:
        try:
            pixels.append(transform(load_image(path)).numpy())
        except CaptionerError as e:
            log.warning("calibration: skipped %s", e)
            skipped += 1
    if not pixels:
        raise FormatError(f"{chosen[0]}: none of the {len(chosen)} calibration images could be read")
    if skipped:
        log.warning("calibration: %d of %d images skipped", skipped, len(chosen))
    return np.stack(pixels).astype(np.float32)


def quantize_encoder(fp32: Path, out: Path, pixels: np.ndarray) -> float:
    """Write the int8 version of the encoder graph `fp32` ((B, 3, S, S) "pixels" -> "grid") to `out`,
    calibrated on `pixels` (N, 3, S, S). Returns the int8 grids' relative difference from float32 on
    those pixels (‖int8 − fp32‖ / ‖fp32‖); raises FormatError above INT8_TOLERANCE."""
    import onnx
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Photos(CalibrationDataReader):
        def __init__(self) -> None:
            self.rows = iter(pixels[i : i + 1] for i in range(len(pixels)))

        def get_next(self) -> dict[str, np.ndarray] | None:
            row = next(self.rows, None)
            return None if row is None else {"pixels": row}

    fp32, out = Path(fp32).resolve(), Path(out).resolve()
    with tempfile.TemporaryDirectory(prefix="captioner-int8-") as tmp, _working_directory(Path(tmp)):
        prepared = Path(tmp) / "prepared.onnx"
        try:
            quant_pre_process(str(fp32), str(prepared))  # shapes inferred, graph simplified
            convs = [n.name for n in onnx.load(str(prepared)).graph.node if n.op_type == "Conv"]  # in graph order
            quantize_static(str(prepared), str(out), Photos(), quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            calibrate_method=CalibrationMethod.MinMax,
                            nodes_to_exclude=convs[: min(FLOAT_CONVS, len(convs) // 8)])
        except Exception as e:  # noqa: BLE001 - ONNX Runtime's tools raise bare Exceptions for graphs they cannot handle
            out.unlink(missing_ok=True)
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise FormatError(f"its encoder could not be quantized to int8 ({reason}); export without --quantize") from None
    difference = relative_difference(fp32, out, pixels)
    if difference > INT8_TOLERANCE:
        out.unlink(missing_ok=True)
        raise FormatError(f"its int8 encoder differs from float32 by {difference:.0%} on the calibration "
                          f"photos (more than {INT8_TOLERANCE:.0%}); export without --quantize")
    return difference


@contextlib.contextmanager
def _working_directory(path: Path) -> Iterator[None]:
    """Run inside `path`: ONNX Runtime's shape inference saves its half-inferred graph
    ("sym_shape_infer_temp.onnx" and a data file) into the working directory when it fails."""
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def relative_difference(fp32: Path, int8: Path, pixels: np.ndarray) -> float:
    """‖int8(pixels) − fp32(pixels)‖ / ‖fp32(pixels)‖ over every grid value."""
    from captioner.deploy.folder import ort_session
    from captioner.deploy.runtime import encode_in_chunks

    images = torch.from_numpy(pixels)
    want, got = (encode_in_chunks(ort_session(path, 1), images) for path in (fp32, int8))  # (N, L, D) each
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want).clamp_min(1e-12))
