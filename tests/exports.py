"""Tiny random-encoder checkpoints and their ONNX exports (made once per test process), with random
images, for the export, runtime and packaging tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import PIL.Image
import torch

from captioner.config import Config, DecodeConfig, DecoderConfig, EncoderConfig, ModelConfig
from captioner.data.vocab import build_vocabulary
from captioner.model import build_model
from captioner.model.checkpoint import save_checkpoint

from servers import CAPTIONS

# decoder layouts every export test runs on: both places of attention, and a two-scale encoder grid with a word
# detector (words.onnx)
DECODERS = {"after-none": {"attend": "after", "init_pooling": "none"},
            "before-mean": {"attend": "before", "init_pooling": "mean", "position": False},
            "two-scale-grid": {"attend": "after", "init_pooling": "mean", "two_scale": True, "concepts": True}}
_EXPORTS: dict[str, tuple] = {}


def tiny_checkpoint(path: Path, two_scale: bool = False, **decoder) -> Path:
    """An untrained 64 px model on the three CAPTIONS' words, its readout and attention scaled up so that
    searches have no near-ties and maps something to compare."""
    torch.manual_seed(0)
    model_cfg = ModelConfig(encoder=EncoderConfig(name="random", image_size=64, two_scale=two_scale),
                            decoder=DecoderConfig(embed_dim=16, hidden_dim=32, attention_dim=16, dropout=0.0, **decoder))
    vocab = build_vocabulary(CAPTIONS)
    model = build_model(model_cfg, len(vocab), pretrained=False)
    with torch.no_grad():
        model.decoder.readout.weight.mul_(4.0)  # peaked word distributions: no near-ties
        model.decoder.attention.score.weight.mul_(20.0)  # maps with something to compare
        if model.decoder.detects_words:  # a detector sure of some words, unsure of others
            model.decoder.concepts.bias.normal_(-3.0, 2.0)
    return save_checkpoint(path, Config(model=model_cfg, decode=DecodeConfig(beam_size=3, max_length=8)), vocab,
                           model.state_dict())


def random_images(n: int = 6) -> list[PIL.Image.Image]:
    """`n` noise images, 64 px wide and 48, 56, ... px high (always the same)."""
    rng = np.random.default_rng(0)
    return [PIL.Image.fromarray(rng.integers(0, 256, (48 + 8 * i, 64, 3), dtype=np.uint8)) for i in range(n)]


def exported_once(tmp_path_factory, name: str) -> tuple:
    """(checkpoint, export report) of the DECODERS layout `name`, exported on first use (needs onnxruntime)."""
    from captioner.deploy.export import export_onnx

    if name not in _EXPORTS:
        folder = tmp_path_factory.mktemp("onnx")
        checkpoint = tiny_checkpoint(folder / "tiny.pt", **DECODERS[name])
        _EXPORTS[name] = checkpoint, export_onnx(checkpoint, folder / "export")
    return _EXPORTS[name]
