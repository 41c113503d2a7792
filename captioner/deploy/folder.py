"""An export folder and what reads it without torch: its manifest, its graphs as ONNX Runtime
sessions, the encoder run in chunks, the cache of exported checkpoints and the bundled model.

The bundled model is an export folder shipped inside the package (`captioner/models/flickr8k/`,
package data): `captioner caption` and `captioner serve` use it when no --checkpoint is given.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from captioner.config import ConfigError, DecodeConfig
from captioner.config.parse import from_dict
from captioner.data.vocab import Vocabulary, VocabularyError
from captioner.deploy import EXPORT_VERSION, GRAPHS, MANIFEST, WORDS, FormatError
from captioner.files import cache_home
from captioner.model.grid import CPU_CHUNK

log = logging.getLogger(__name__)

BUNDLED = "models/flickr8k"  # the bundled export, relative to the package


def bundled_model() -> Path | None:
    """The export folder shipped with the package, when it holds one."""
    folder = Path(str(resources.files("captioner"))) / BUNDLED
    return folder if (folder / MANIFEST).is_file() else None


def cpu_threads() -> int:
    """Threads for the encoder: OMP_NUM_THREADS when set (as torch reads it), else the CPUs this
    process may run on."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "")))
    except ValueError:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


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


def graph_sessions(folder: Path, threads: int) -> dict[str, Any]:
    """A session for each graph of an export folder, the word detector's (`WORDS`) when it was
    exported: the encoder's convolutions spread over `threads`; a decoder step is a few small matrix
    products, which a second thread only slows down (its sync costs more than the work: 84 vs 19
    images/s of beam search at batch 1). The sessions are built side by side: ONNX Runtime lets go of
    the GIL while it loads and optimizes a graph (the bundled model's four: 155-167 ms against 227-271 one
    after another, on an AVX2 EPYC)."""
    names = [*GRAPHS, *([WORDS] if (folder / f"{WORDS}.onnx").is_file() else [])]
    with ThreadPoolExecutor(len(names)) as pool:
        sessions = pool.map(lambda g: ort_session(folder / f"{g}.onnx", threads if g == "encoder" else 1), names)
        return dict(zip(names, sessions))


def encode_chunks(session: Any, pixels: np.ndarray) -> np.ndarray:
    """An encoder graph's (B, 3, S, S) float32 -> (B, L, D_enc), CPU_CHUNK images a call (as
    `Encoder.infer`: the activations of one or two images stay in cache; 62 against 42-59 images/s
    in one call of 32)."""
    x = np.ascontiguousarray(pixels, dtype=np.float32)
    return np.concatenate([session.run(None, {"pixels": x[i : i + CPU_CHUNK]})[0] for i in range(0, len(x), CPU_CHUNK)])


def read_manifest(folder: Path) -> dict[str, Any]:
    """manifest.json of an export folder whose graphs are all there, holding what running it reads (the
    encoder's settings, a vocabulary, decode settings this code accepts); FormatError (one line, naming
    the manifest) if not."""
    missing = [name for name in (MANIFEST, *(f"{g}.onnx" for g in GRAPHS)) if not (folder / name).is_file()]
    if missing:
        raise FormatError(f"{folder}: not an export folder of `captioner export` ({', '.join(missing)} missing)")
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "captioner-onnx":
        raise FormatError(f"{path}: not a captioner export manifest")
    lacking = [key for key in ("encoder", "vocabulary", "decode") if key not in manifest]
    if lacking:
        raise FormatError(f"{path}: lacks {', '.join(lacking)}; export the checkpoint again")
    if not isinstance(manifest["encoder"], dict):
        raise FormatError(f"{path}: its encoder is a {type(manifest['encoder']).__name__}, not a mapping")
    try:
        Vocabulary.from_list(manifest["vocabulary"])
        from_dict(DecodeConfig, manifest["decode"], "decode")
    except (VocabularyError, ConfigError) as e:
        raise FormatError(f"{path}: {e}") from None
    return manifest


def exported(source: str | Path) -> Path:
    """An export folder for `source`: itself, or (for a checkpoint) its export in the cache, made once
    (which imports torch, that once)."""
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
