"""Filling the feature cache with ONNX Runtime: the frozen encoder's graph, 2-4x faster on a CPU.

`cache_encoder(encoder, device, runtime)` is what training and `prepare` encode the cache with. On a
CPU with the `onnx` extra installed (`data.cache_runtime: auto`, the default, for every backbone but
the tiny `random` one), or always with `onnx`,
it is an `OnnxGridEncoder`: the torch `Encoder` (its identity, cache key, preprocessing) whose
`infer` runs the encoder exported to ONNX. The graph is exported once per cache key into
$CAPTIONER_CACHE/onnx/ and compared with torch before use; its grids equal torch's to ~1e-5, so the
cache key (and a cache built with either runtime) stays the same.
"""
from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

import torch
from torch import Tensor

from captioner.deploy import FormatError, require_onnx
from captioner.deploy.folder import ort_session
from captioner.deploy.runtime import encode_in_chunks
from captioner.files import cache_home
from captioner.model.encoder import Encoder
from captioner.device import resolve_device

log = logging.getLogger(__name__)


class OnnxGridEncoder:
    """A frozen `Encoder` with `infer` in ONNX Runtime; every other attribute is the encoder's."""

    def __init__(self, encoder: Encoder) -> None:
        self.encoder, self.session = encoder, None  # exported at the first `infer`: a cache with nothing to do costs nothing

    def __getattr__(self, name: str) -> Any:
        return getattr(self.encoder, name)

    def infer(self, images: Tensor) -> Tensor:
        """(B, 3, S, S) -> (B, L, D), CPU_CHUNK images a call."""
        if self.session is None:
            self.session = _exported_encoder(self.encoder)
        return encode_in_chunks(self.session, images)

    def to(self, device: torch.device | str) -> OnnxGridEncoder:
        if torch.device(device).type != "cpu":
            raise FormatError(f"the ONNX encoder runs on the CPU, not {device}")
        return self

    def eval(self) -> OnnxGridEncoder:
        self.encoder.eval()
        return self

    def train(self, mode: bool = True) -> OnnxGridEncoder:
        self.encoder.train(mode)
        return self


def _exported_encoder(encoder: Encoder) -> Any:
    from captioner.deploy.export import export_verified

    folder = cache_home() / "onnx" / f"encoder-{hashlib.sha256(encoder.cache_key().encode()).hexdigest()[:16]}"
    path = folder / "encoder.onnx"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        pixels = torch.randn(2, 3, encoder.image_size, encoder.image_size, generator=torch.Generator().manual_seed(0))
        log.info("%s: exporting the encoder to ONNX for the cache (once) in %s", encoder.name, folder)
        partial = folder / f".encoder.{os.getpid()}.onnx"
        try:
            export_verified(encoder, (pixels,), ["pixels"], ["grid"], partial, [(pixels[:1],)],
                            name=f"{encoder.name}: the cache's ONNX encoder")
        except FormatError as e:
            raise FormatError(f"{e}; use data.cache_runtime=torch") from None
        os.replace(partial, path)
    return ort_session(path, torch.get_num_threads(), spin=True)


def cache_encoder(encoder: Encoder, device: torch.device | str, runtime: str = "auto") -> Encoder | OnnxGridEncoder:
    """The encoder to fill the feature cache with: ONNX Runtime for `runtime` 'onnx', and for 'auto' on a
    CPU when the extra is installed and the backbone is a real one (the tiny `random` test CNN costs
    less to run than to export); else the torch encoder itself."""
    device = resolve_device(device) if isinstance(device, str) else device
    if runtime == "torch" or (runtime == "auto" and (device.type != "cpu" or encoder.name == "random")):
        return encoder
    try:
        require_onnx()
    except FormatError:
        if runtime == "onnx":
            raise
        return encoder
    if device.type != "cpu":
        raise FormatError(f"data.cache_runtime 'onnx' runs on the CPU, not {device} (use auto or torch)")
    return OnnxGridEncoder(encoder)
