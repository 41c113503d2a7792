"""Model: image -> grid of regions -> words, with attention at every word.

    backbones.py      the registry of pretrained CNNs and their (offline) weights
    encoder.py        `Encoder`: images (B, 3, S, S) -> regions (B, L, D), frozen or fine-tuned
    attention.py      Bahdanau attention, keys computed once per image
    decoder.py        `AttentionDecoder`: GRU + attention, one `step`, a packed teacher-forced pass
    caption_model.py  `CaptionModel` = encoder + decoder, `build_model`
    checkpoint.py     one file per model: config, vocabulary, weights (and resume state)
"""
from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {  # name -> its module
    "CaptionModel": "captioner.model.caption_model",
    "build_model": "captioner.model.caption_model",
    "Checkpoint": "captioner.model.checkpoint",
    "CheckpointError": "captioner.model.checkpoint",
    "load_checkpoint": "captioner.model.checkpoint",
    "restore_model": "captioner.model.checkpoint",
    "save_checkpoint": "captioner.model.checkpoint",
    "AttentionDecoder": "captioner.model.decoder",
    "DecoderOutput": "captioner.model.decoder",
    "Memory": "captioner.model.decoder",
    "Encoder": "captioner.model.encoder",
    "build_encoder": "captioner.model.encoder",
}
__all__ = ["AttentionDecoder", "CaptionModel", "Checkpoint", "CheckpointError", "DecoderOutput", "Encoder", "Memory",
           "build_encoder", "build_model", "load_checkpoint", "restore_model", "save_checkpoint"]


def __getattr__(name: str) -> Any:
    """A public name, imported on first use, so that importing one light module of the package
    (`captioner.model.grid`) does not import the rest of it, torch included."""
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
