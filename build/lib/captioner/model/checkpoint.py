"""Checkpoints: one file with everything needed to rebuild and use (or resume) a model.

Layout of the file (a dict, loadable with `torch.load(..., weights_only=True)`):
    format: "captioner", version: 2
    config: the run's whole config as nested dicts (model, data, train, decode), stored once
    vocab: list[str], the vocabulary in id order
    model: the CaptionModel state dict
    train_state: None, or what resuming needs (optimizer, scheduler, scaler, position, RNG states,
                 data order); only tensors and plain Python values
    meta: small dict of facts for people (metrics, best step, split sizes, ...)

Version 1 files (a `model_config`, and the run config copied into train_state and meta) load too.
Writing goes to a temporary file in the same folder, fsynced, then renamed over the target, so
a reader (or a crash) never sees half a checkpoint. Loading is here and nowhere else.
"""
from __future__ import annotations

import logging
import os
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from captioner.config import Config, ConfigError, ModelConfig, parse_config, to_dict
from captioner.data.vocab import Vocabulary
from captioner.errors import CaptionerError
from captioner.model.caption_model import CaptionModel, build_model

log = logging.getLogger(__name__)

FORMAT = "captioner"
VERSION = 2


class CheckpointError(CaptionerError):
    """A file that is not a captioner checkpoint, or one that does not fit this code."""


@dataclass
class Checkpoint:
    config: Config  # the run's config: model, data, decode (the defaults a caption call uses), train
    vocab: Vocabulary
    model_state: dict[str, torch.Tensor]
    train_state: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

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
    """Write a checkpoint atomically (temp file + fsync + rename). Returns the path."""
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
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read and validate a checkpoint (tensors on the CPU). Raises CheckpointError with one line."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    if not zipfile.is_zipfile(path):  # torch.save has written zip archives since PyTorch 1.6
        raise CheckpointError(f"{path}: not a readable checkpoint (not a PyTorch file)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises many types on foreign bytes; all mean "not readable"
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: not a readable checkpoint ({reason[:200]})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a captioner checkpoint (no 'format: {FORMAT}' marker)")
    if payload.get("version") == 1:
        payload = _upgrade_v1(payload)
    if payload.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint version {payload.get('version')!r}, this code reads 1 and {VERSION}")
    missing = [k for k in ("config", "vocab", "model") if k not in payload]
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks {', '.join(missing)}")
    try:
        config = parse_config(payload["config"])
    except ConfigError as e:
        raise CheckpointError(f"{path}: its config does not fit this code: {e}") from None
    return Checkpoint(
        config=config,
        vocab=Vocabulary.from_list(payload["vocab"]),
        model_state=payload["model"],
        train_state=payload.get("train_state"),
        meta=payload.get("meta") or {},
    )


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
    return {**payload, "version": VERSION, "config": config, "model": state, "train_state": train_state,
            "meta": meta}


def restore_model(ckpt: Checkpoint, path: str | Path = "checkpoint") -> CaptionModel:
    """Rebuild the model from a checkpoint's config and load its weights strictly (on the CPU)."""
    model = build_model(ckpt.model_config, len(ckpt.vocab), pretrained=False)
    try:
        model.load_state_dict(ckpt.model_state, strict=True)
    except RuntimeError as e:
        first = " ".join(str(e).split())[:300]
        raise CheckpointError(f"{path}: weights do not fit the model its config describes ({first})") from None
    return model


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[CaptionModel, Checkpoint]:
    """Load a checkpoint and return the model in eval mode on `device`, with the checkpoint."""
    ckpt = load_checkpoint(path)
    model = restore_model(ckpt, path).to(device).eval()
    return model, ckpt
