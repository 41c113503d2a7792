"""Checkpoints: one file with everything needed to rebuild and use (or resume) a model.

Layout of the file (a dict, loadable with `torch.load(..., weights_only=True)`):
    format: "captioner", version: 3
    config: the run's whole config as nested dicts (model, data, train, decode), stored once
    vocab: list[str], the vocabulary in id order
    model: the CaptionModel state dict
    train_state: None, or what resuming needs (optimizer, scheduler, scaler, position, RNG states,
                 data order); only tensors and plain Python values
    meta: small dict of facts for people (metrics, best step, split sizes, ...)

Version 1 files (a `model_config`, and the run config copied into train_state and meta) and version 2
files (no `decoder.detector_slots`) load too.
Writing goes to a temporary file in the same folder, fsynced, then renamed over the target, so
a reader (or a crash) never sees half a checkpoint. Loading is here and nowhere else.
"""
from __future__ import annotations

import io
import logging
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from captioner.config import Config, ConfigError, ModelConfig, parse_config, to_dict
from captioner.data.vocab import Vocabulary, VocabularyError
from captioner.errors import CaptionerError
from captioner.files import atomic_open
from captioner.model.caption_model import CaptionModel, build_model
from captioner.model.concepts import INITIAL_DETECTOR_BIAS, concept_slots

log = logging.getLogger(__name__)

FORMAT = "captioner"
VERSION = 3


class CheckpointError(CaptionerError):
    """A file that is not a captioner checkpoint, or one that does not fit this code."""


@dataclass
class Checkpoint:
    config: Config  # the run's config: model, data, decode (the defaults a caption call uses), train
    vocab: Vocabulary
    model_state: dict[str, torch.Tensor]
    train_state: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    source: str | None = None  # the file it was read from (what messages about it name)

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model


def save_checkpoint(
    path: str | Path,
    config: Config,
    vocab: Vocabulary,
    model_state: dict[str, torch.Tensor],
    train_state: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
) -> Path:
    """Write a checkpoint atomically (serialised in memory, then temp file + fsync + rename): a full
    disk or a kill leaves the previous file at `path` as it was. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "config": to_dict(config),
        "vocab": vocab.to_list(),
        "model": {k: v.detach().cpu() for k, v in model_state.items()},
        "train_state": train_state,
        "meta": meta or {},
    }
    buffer = io.BytesIO()  # torch.save reports a full disk as an opaque RuntimeError; file.write as ENOSPC
    torch.save(payload, buffer)
    try:
        with atomic_open(path, "wb") as f:
            f.write(buffer.getbuffer())
    except OSError as e:
        raise CheckpointError(f"{path}: could not write the checkpoint ({e.strerror or e}); "
                              f"the previous {path.name}, if any, is unchanged") from None
    return path


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read and check a checkpoint (tensors on the CPU). Raises CheckpointError with one line: not
    found, not a PyTorch file, truncated, holding code (refused, never run), not a captioner
    checkpoint, from a version this code cannot read, with parts missing or not of their types, or with
    weights that are NaN or infinite."""
    path = Path(path)
    payload = _read(path)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a captioner checkpoint (no 'format: {FORMAT}' marker)")
    _check_layout(path, payload)
    if payload.get("version") == 1:
        payload = _upgrade_v1(payload)
    if payload.get("version") == 2:
        payload = _upgrade_v2(payload)
    if payload.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint version {payload.get('version')!r}, this code reads 1 to {VERSION}")
    missing = [k for k in ("config", "vocab", "model") if payload.get(k) is None]
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks {', '.join(missing)}")
    try:
        config = parse_config(payload["config"])
    except ConfigError as e:
        raise CheckpointError(f"{path}: its config does not fit this code: {e}") from None
    bad = [k for k, v in payload["model"].items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise CheckpointError(f"{path}: {len(bad)} weight tensors hold NaN or infinite values (e.g. {bad[0]}): "
                              f"the training diverged; use an earlier checkpoint")
    return Checkpoint(
        config=config,
        vocab=Vocabulary.from_list(payload["vocab"]),
        model_state=payload["model"],
        train_state=payload.get("train_state"),
        meta=payload.get("meta") or {},
        source=str(path),
    )


def _check_layout(path: Path, payload: dict[str, Any]) -> None:
    """CheckpointError (one line) for a part that loading reads but that is not of its type, in a file with
    the format marker (made by hand, or by other code): the weights a mapping of names to tensors, the
    vocabulary a list of words, the rest mappings. A missing part is reported after the version upgrades."""
    model = payload.get("model")
    if "model" in payload and not (isinstance(model, dict) and all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items())):
        raise CheckpointError(f"{path}: its 'model' is not a state dict (weight names -> tensors)")
    for key in ("config", "model_config", "train_state", "meta"):
        if payload.get(key) is not None and not isinstance(payload[key], dict):
            raise CheckpointError(f"{path}: its '{key}' is a {type(payload[key]).__name__}, not a mapping")
    if "vocab" in payload:
        try:
            Vocabulary.from_list(payload["vocab"])
        except VocabularyError as e:
            raise CheckpointError(f"{path}: {e}") from None


def _read(path: Path) -> Any:
    """torch.load(weights_only=True) with one-line errors for everything a file can be instead."""
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found" if not path.exists() else f"{path}: not a file")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror})") from None
    if head != b"PK\x03\x04":  # torch.save has written zip archives since PyTorch 1.6
        raise CheckpointError(f"{path}: not a readable checkpoint (not a PyTorch file)")
    if not zipfile.is_zipfile(path):  # a zip's directory is written last: the file was cut short
        raise CheckpointError(f"{path}: truncated checkpoint ({path.stat().st_size:,} bytes; its writing did not "
                              f"finish): use an earlier one")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only load failed" in str(e).lower():
            found = re.search(r"GLOBAL ([\w.]+)", str(e))
            what = f" ({found.group(1)})" if found else ""
            raise CheckpointError(f"{path}: refused: it holds Python objects other than tensors and plain values"
                                  f"{what}, which may contain code; it was not loaded") from None
        raise CheckpointError(f"{path}: damaged checkpoint ({_first_line(e)})") from None
    except Exception as e:  # torch.load raises many types on damaged bytes; all mean "not readable"
        raise CheckpointError(f"{path}: damaged checkpoint ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", str(e)).strip()  # no terminal escape codes
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def _upgrade_v1(payload: dict[str, Any]) -> dict[str, Any]:
    """A version 1 payload in version 2's layout: the run config (kept in train_state and meta, or
    only the model config and the decode settings in `best.pt`) becomes the one `config`."""
    train_state = dict(payload.get("train_state") or {}) or None
    meta = dict(payload.get("meta") or {})
    config = (train_state or {}).pop("config", None) or meta.get("config") or {}
    config = {**config, "model": payload.get("model_config", config.get("model"))}
    for section in ("decode", "data"):  # best.pt and hand-made files kept these in meta
        if section not in config and isinstance(meta.get(section), dict):
            config[section] = meta[section]
    for key in ("config", "decode", "data"):
        meta.pop(key, None)
    state = payload.get("model")
    decoder = (config.get("model") or {}).get("decoder") or {}
    if isinstance(state, dict) and decoder.get("init_pooling") == "none":  # v1 built an unused init_h
        state = {k: v for k, v in state.items() if not k.startswith("decoder.init_h.")}
    return {**payload, "version": 2, "config": config, "model": state, "train_state": train_state, "meta": meta}


def _upgrade_v2(payload: dict[str, Any]) -> dict[str, Any]:
    """A version 2 payload as version 3: a word detector's `decoder.detector_slots` (which output stands
    for each word), which version 2 did not save, recovered from the weights. Grouped training never
    trains a grouped word's own output (`concepts.concept_slots`: "man" reads "person"), so those keep
    their initial bias exactly; the run's `train.concept_groups` cannot say, since a self-critical run
    from a grouped model recorded its own setting, not the detector's."""
    state = payload.get("model")
    if isinstance(state, dict) and "decoder.concepts.bias" in state and isinstance(payload.get("vocab"), list):
        bias = state["decoder.concepts.bias"]
        grouped = concept_slots(Vocabulary.from_list(payload["vocab"]), grouped=True)
        members = grouped != torch.arange(len(grouped))  # words that read another word's output when grouped
        untrained = bias == INITIAL_DETECTOR_BIAS
        state = {**state, "decoder.detector_slots": grouped if bool(members.any() and untrained[members].all())
                 else torch.arange(len(grouped))}
    return {**payload, "version": 3, "model": state}


def restore_model(ckpt: Checkpoint, path: str | Path = "checkpoint") -> CaptionModel:
    """Rebuild the model from a checkpoint's config and load its weights strictly (on the CPU)."""
    model = build_model(ckpt.model_config, len(ckpt.vocab), pretrained=False)
    try:
        model.load_state_dict(ckpt.model_state, strict=True)
    except RuntimeError as e:
        first = " ".join(str(e).split())[:300]
        raise CheckpointError(f"{path}: weights do not fit the model its config describes ({first})") from None
    return model


def average_checkpoints(paths: list[str | Path]) -> Checkpoint:
    """The mean of several checkpoints' weights (say the last few validations of one run), with the
    first one's config, vocabulary and meta and no resume state. They must share the model config,
    the vocabulary and the weights' names and shapes, and the first one's weights must fit its model
    (so the mean loads); integer buffers (BatchNorm's counters) are the first one's."""
    if not paths:
        raise CheckpointError("no checkpoints to average")
    ckpts = [load_checkpoint(p) for p in paths]
    first = ckpts[0]
    restore_model(first, paths[0])
    shapes = {k: tuple(v.shape) for k, v in first.model_state.items()}
    for path, ckpt in zip(paths[1:], ckpts[1:]):
        if ckpt.model_config != first.model_config or ckpt.vocab != first.vocab:
            raise CheckpointError(f"{path}: another model config or vocabulary than {paths[0]}: cannot average")
        theirs = {k: tuple(v.shape) for k, v in ckpt.model_state.items()}
        differ = sorted(k for k in shapes.keys() | theirs.keys() if shapes.get(k) != theirs.get(k))
        if differ:
            raise CheckpointError(f"{path}: other weights than {paths[0]} ({len(differ)} differ in name or shape, "
                                  f"e.g. {differ[0]}: {theirs.get(differ[0], 'missing')} against "
                                  f"{shapes.get(differ[0], 'missing')}): cannot average")
    state = {}
    for key, value in first.model_state.items():
        if value.is_floating_point():
            state[key] = torch.stack([c.model_state[key].float() for c in ckpts]).mean(0).to(value.dtype)
        else:
            state[key] = value
    meta = {**first.meta, "averaged": [str(p) for p in paths]}
    return Checkpoint(first.config, first.vocab, state, None, meta)
