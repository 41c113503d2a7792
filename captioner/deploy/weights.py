"""How an export stores weights small: rounded in torch, stored so in ONNX, expanded when loaded.

    round_weights(decoder, precision)   a copy of the decoder whose weights are what its graphs hold
    store_weights(path, precision)      rewrite a graph so the weights rounded that way are stored
                                        small, each expanded back to float32 by nodes ONNX Runtime
                                        folds away when it loads the graph (the same arithmetic)

precision "float16": every weight rounded to float16 (half of float32). "int8": each matrix of at
least MIN_SIZE numbers as 8-bit integers times one float32 scale per row (symmetric, the row's
largest |w| -> 127: a word's embedding, an output unit's weights), a quarter of float32, but the
recurrent cell's and the vectors (biases) in float16: the GRU meets its rounding again at every
word (the Flickr8k model's dev CIDEr-D: float16 0.576, int8 but the GRU 0.573, int8 all 0.568).
Only weights the graph holds exactly as rounded are stored small: what the exporter folded from
several weights stays float32.
"""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from torch import nn

from captioner.deploy import SMALL_WEIGHTS
from captioner.model.decoder import AttentionDecoder

MIN_SIZE = 1024  # smaller weights (norms, biases) are left as they are
INT8_MAX = 127


def _int8_rows(w: torch.Tensor) -> torch.Tensor:
    """`w` (R, ...) rounded to int8 steps, one scale per row (its largest |w| / 127)."""
    scale = w.abs().flatten(1).amax(dim=1).div(INT8_MAX).clamp_min(torch.finfo(w.dtype).tiny)  # (R,)
    scale = scale.view(-1, *[1] * (w.dim() - 1))
    return torch.round(w / scale).clamp(-INT8_MAX, INT8_MAX) * scale


def round_weights(decoder: AttentionDecoder, precision: str) -> AttentionDecoder:
    """A copy of `decoder` whose weights are rounded as a `precision` export stores them (kept
    float32): the model such an export holds exactly, and what its graphs are checked against."""
    if precision not in SMALL_WEIGHTS:
        raise ValueError(f"precision {precision!r} is not one of {SMALL_WEIGHTS}")
    decoder = copy.deepcopy(decoder)
    recurrent = {id(p) for m in decoder.modules() if isinstance(m, nn.RNNCellBase | nn.RNNBase) for p in m.parameters()}
    with torch.no_grad():
        for p in decoder.parameters():
            if precision == "int8" and p.dim() >= 2 and p.numel() >= MIN_SIZE and id(p) not in recurrent:
                p.copy_(_int8_rows(p))
            else:
                p.copy_(p.half().float())
    return decoder


def _row_scales(v: np.ndarray, chunk: int = 16) -> np.ndarray | None:
    """One scale per row of `v` (R, C) with every value an integer multiple of it, at most 127 times
    (the row's largest |v| / k, the largest such k <= 127: a slice of a rounded row may not hold its
    largest value); None if some row has none."""
    ks = np.arange(INT8_MAX, 0, -1, dtype=np.float32)  # (K,) finest first
    largest = np.abs(v).max(axis=1)
    scales = np.empty(len(v), np.float32)
    for start in range(0, len(v), chunk):
        rows = v[start:start + chunk, None, :]  # (r, 1, C)
        s = largest[start:start + chunk, None] / ks  # (r, K)
        s[s == 0] = 1.0
        fits = np.all(np.abs(np.rint(rows / s[..., None]) * s[..., None] - rows) <= 1e-6 * np.abs(rows), axis=2)
        if not fits.any(axis=1).all():
            return None
        scales[start:start + chunk] = s[np.arange(len(s)), fits.argmax(axis=1)]  # (r,)
    return scales


def as_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(q int8, scale float32) with q * scale == `w` (2-D) to float32 rounding, one scale per row or
    per column (the exporter may store a matrix transposed, or slices of it); None if `w` is not so
    rounded."""
    for rows in (w, w.T):
        scales = _row_scales(rows)
        if scales is not None:
            scale = scales[:, None] if rows is w else scales[None, :]
            return np.rint(w / scale).astype(np.int8), scale
    return None


def store_weights(path: Path, precision: str, min_size: int = MIN_SIZE, exact: bool = True) -> None:
    """Rewrite the ONNX graph at `path` so its float32 weights of at least `min_size` numbers that
    `round_weights(..., precision)` rounded are stored small (int8 matrices; float16 where float16
    holds them exactly). `exact` False (float16 only): every such weight rounded to float16."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(path))
    graph, expand, kept = model.graph, [], []
    for init in graph.initializer:
        w = numpy_helper.to_array(init) if init.data_type == onnx.TensorProto.FLOAT else None
        int8 = as_int8(w) if precision == "int8" and w is not None and w.ndim == 2 and w.size >= min_size else None
        if int8 is not None:
            q, scale = int8
            kept += [numpy_helper.from_array(q, init.name + "_int8"),
                     numpy_helper.from_array(scale, init.name + "_scale")]
            expand += [helper.make_node("Cast", [init.name + "_int8"], [init.name + "_q"], to=onnx.TensorProto.FLOAT),
                       helper.make_node("Mul", [init.name + "_q", init.name + "_scale"], [init.name])]
        elif (w is not None and w.size >= min_size
              and (not exact or np.array_equal(w.astype(np.float16), w))):
            kept.append(numpy_helper.from_array(w.astype(np.float16), init.name + "_fp16"))
            expand.append(helper.make_node("Cast", [init.name + "_fp16"], [init.name], to=onnx.TensorProto.FLOAT))
        else:
            kept.append(init)
    del graph.initializer[:]
    graph.initializer.extend(kept)
    nodes = expand + list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
