"""Captioning with ONNX Runtime: the exported graphs behind the `Captioner` API.

`onnx_captioner(folder_or_checkpoint)` returns a `Captioner` whose model is an `OnnxModel`: its
encoder runs encoder.onnx, its decoder answers `memory`, `init_hidden` and `step` from memory.onnx
and step.onnx, so the project's own beam search (captioner.decoding.search) drives it exactly as it
drives the torch decoder, and captions, scores and maps come out the same. A checkpoint given
instead of an export folder is exported once into the cache ($CAPTIONER_CACHE/onnx/<digest>).

Sessions run on the CPU with every graph optimisation on; the encoder's with as many threads as
torch uses (`torch.set_num_threads`, or OMP_NUM_THREADS), the decoder's with one.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torchvision.transforms import InterpolationMode

from captioner.config import DataConfig, DecodeConfig
from captioner.config.parse import from_dict
from captioner.data.vocab import Vocabulary
from captioner.decoding.captioner import Captioner
from captioner.deploy import EXPORT_VERSION, GRAPHS, MANIFEST, FormatError, require_onnx
from captioner.files import cache_home
from captioner.model.decoder import Memory, StepOutput
from captioner.model.encoder import CPU_CHUNK, Cells, eval_transform

log = logging.getLogger(__name__)


def ort_session(path: Path, threads: int, spin: bool = False) -> Any:
    """An ONNX Runtime session on the CPU. `spin`: idle workers spin-wait for the next run (only for
    a session that runs alone, back to back: the feature cache)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    # Idle workers that spin between runs take the core the beam search (its own one-thread session)
    # needs: one image with a two-thread encoder took 64-73 ms spinning against 36-37 ms without.
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's errors for a missing or damaged graph
        raise FormatError(f"{path}: not a usable ONNX graph ({type(e).__name__}: {str(e)[:160]})") from None


def encode_in_chunks(session: Any, pixels: Tensor) -> Tensor:
    """An encoder graph's (B, 3, S, S) -> (B, L, D_enc), CPU_CHUNK images a call (as `Encoder.infer`:
    the activations of one or two images stay in cache; 62 against 42-59 images/s in one call of 32)."""
    x = pixels.float().contiguous().numpy()
    return torch.from_numpy(np.concatenate([session.run(None, {"pixels": x[i : i + CPU_CHUNK]})[0]
                                            for i in range(0, len(x), CPU_CHUNK)]))


class OnnxEncoder:
    """encoder.onnx as `Encoder`'s inference side: `infer`, `transform`, `grid`, `cells`."""

    def __init__(self, session: Any, spec: dict[str, Any]) -> None:
        self.session = session
        self.name, self.image_size = spec["name"], int(spec["image_size"])
        self.grid: tuple[int, int] = tuple(spec["grid"])  # type: ignore[assignment]
        self.cells = Cells(**spec["cells"])
        self._transform = eval_transform(self.image_size, InterpolationMode(spec["interpolation"]), spec["mean"],
                                         spec["std"])

    def transform(self, train: bool = False) -> Any:
        return self._transform

    def infer(self, pixels: Tensor) -> Tensor:
        """(B, 3, S, S) -> (B, L, D_enc)."""
        return encode_in_chunks(self.session, pixels)


@dataclass(frozen=True)
class OnnxMemory(Memory):
    """Memory that also carries memory.onnx's initial state (selecting rows drops it: only the
    search's start needs it)."""

    initial: Tensor | None = None


class OnnxDecoder:
    """memory.onnx and step.onnx as the decoder interface beam search uses."""

    def __init__(self, memory: Any, step: Any) -> None:
        self.memory_session, self.step_session = memory, step
        self.training = False

    def memory(self, grid: Tensor) -> OnnxMemory:
        features, keys, state = self.memory_session.run(None, {"grid": grid.float().contiguous().numpy()})
        return OnnxMemory(torch.from_numpy(features), torch.from_numpy(keys), torch.from_numpy(state))

    def init_hidden(self, memory: OnnxMemory) -> Tensor:
        return memory.initial

    def step(self, tokens: Tensor, state: Tensor, memory: Memory) -> StepOutput:
        logits, alpha, new_state = self.step_session.run(None, {
            "tokens": tokens.contiguous().numpy(), "state": state.contiguous().numpy(),
            "features": memory.features.contiguous().numpy(), "keys": memory.keys.contiguous().numpy()})
        return StepOutput(torch.from_numpy(logits), torch.from_numpy(alpha), torch.from_numpy(new_state))


class OnnxModel:
    """What `Captioner` needs of a model: `encoder`, `decoder`, `to` (the CPU only) and `eval`."""

    def __init__(self, encoder: OnnxEncoder, decoder: OnnxDecoder) -> None:
        self.encoder, self.decoder = encoder, decoder

    def to(self, device: torch.device | str) -> OnnxModel:
        if torch.device(device).type != "cpu":
            raise FormatError(f"the ONNX runtime runs on the CPU here, not {device} (use --runtime torch)")
        return self

    def eval(self) -> OnnxModel:
        return self


def read_manifest(folder: Path) -> dict[str, Any]:
    missing = [name for name in (MANIFEST, *(f"{g}.onnx" for g in GRAPHS)) if not (folder / name).is_file()]
    if missing:
        raise FormatError(f"{folder}: not an export folder of `captioner export` ({', '.join(missing)} missing)")
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise FormatError(f"{folder / MANIFEST}: unreadable ({e})") from None
    if manifest.get("format") != "captioner-onnx":
        raise FormatError(f"{folder / MANIFEST}: not a captioner export manifest")
    return manifest


def exported(source: str | Path) -> Path:
    """An export folder for `source`: itself, or (for a checkpoint) its export in the cache, made once."""
    source = Path(source)
    if source.is_dir():
        return source
    if not source.is_file():
        raise FormatError(f"{source}: no such checkpoint or export folder")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    folder = cache_home() / "onnx" / f"{digest}-v{EXPORT_VERSION}"
    if not (folder / MANIFEST).is_file():
        from captioner.deploy.export import export_onnx

        log.warning("exporting %s to ONNX in %s (once)", source, folder)
        export_onnx(source, folder)
    return folder


def exported_data(source: str | Path) -> DataConfig:
    """The data settings of the checkpoint behind `source` (an export folder or a checkpoint), which
    `captioner evaluate --runtime onnx` scores on (its validation split, its seed)."""
    folder = exported(source)
    manifest = read_manifest(folder)
    if "data" not in manifest:
        raise FormatError(f"{folder}: exported before exports recorded their data settings; export it again")
    return from_dict(DataConfig, manifest["data"], "data")


def onnx_captioner(source: str | Path, decode: DecodeConfig | None = None, threads: int | None = None) -> Captioner:
    """A `Captioner` on ONNX Runtime, from an export folder or a checkpoint (exported once, cached)."""
    require_onnx()
    folder = exported(source)
    manifest = read_manifest(folder)
    threads = threads or torch.get_num_threads()
    # The encoder's convolutions spread over `threads`; a decoder step is a few small matrix products,
    # which a second thread only slows down (its sync costs more than the work: 84 vs 19 images/s of
    # beam search at batch 1).
    sessions = {g: ort_session(folder / f"{g}.onnx", threads if g == "encoder" else 1) for g in GRAPHS}
    model = OnnxModel(OnnxEncoder(sessions["encoder"], manifest["encoder"]),
                      OnnxDecoder(sessions["memory"], sessions["step"]))
    return Captioner(model, Vocabulary.from_list(manifest["vocabulary"]),  # type: ignore[arg-type]
                     decode or DecodeConfig(**manifest["decode"]), "cpu", manifest.get("meta", {}))
