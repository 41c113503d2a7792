"""An export folder's graphs as numpy functions, with the encoder's preprocessing: no torch.

    Preprocess    RGB image -> (3, S, S) float32, `model.encoder.eval_transform` without torch
    LiteEncoder   encoder.onnx: (B, 3, S, S) -> (B, L, D_enc), with its grid, cells and preprocessing
    LiteDecoder   memory.onnx once per image, step.onnx once per word
    load_graphs   the three from an export folder's manifest and graphs

Shapes: B images, S input side, L = H'·W' regions, R rows, D widths, A attention width, S_h state
width, V vocabulary.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from captioner.deploy import WORDS, FormatError
from captioner.deploy.folder import encode_chunks, graph_sessions
from captioner.model.grid import Cells

# torchvision's InterpolationMode values (what the manifest records) -> Pillow's filters, as
# torchvision maps them when it resizes a PIL image
RESAMPLE = {"nearest": Image.NEAREST, "bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC, "box": Image.BOX,
            "hamming": Image.HAMMING, "lanczos": Image.LANCZOS}


class Preprocess:
    """RGB image -> (3, S, S) float32 normalised pixels: one square resize (aspect not kept, nothing
    cropped), /255, the weights' mean and std. torchvision's `Resize` of a PIL image is Pillow's
    `resize` with the same filter, and ToTensor and Normalize are these float32 operations, so the
    pixels equal `eval_transform`'s."""

    def __init__(self, image_size: int, interpolation: str, mean: Sequence[float], std: Sequence[float]) -> None:
        if interpolation not in RESAMPLE:
            raise FormatError(f"interpolation {interpolation!r}: expected one of {', '.join(RESAMPLE)}")
        self.size, self.resample = (image_size, image_size), RESAMPLE[interpolation]
        self.mean = np.asarray(mean, dtype=np.float32)[:, None, None]  # (3, 1, 1)
        self.std = np.asarray(std, dtype=np.float32)[:, None, None]  # (3, 1, 1)

    def __call__(self, image: Image.Image) -> np.ndarray:
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        x = np.asarray(rgb.resize(self.size, self.resample), dtype=np.float32).transpose(2, 0, 1)  # (3, S, S)
        return (x / np.float32(255) - self.mean) / self.std


class LiteEncoder:
    """encoder.onnx: `infer`, `transform`, and what the pictures and the server read (`name`,
    `image_size`, `grid`, `cells`)."""

    def __init__(self, session: Any, spec: dict[str, Any]) -> None:
        self.session = session
        self.name, self.image_size = str(spec["name"]), int(spec["image_size"])
        self.grid: tuple[int, int] = tuple(int(n) for n in spec["grid"])  # type: ignore[assignment]
        self.cells = Cells(**spec["cells"])
        self.transform = Preprocess(self.image_size, spec["interpolation"], spec["mean"], spec["std"])

    def infer(self, pixels: np.ndarray) -> np.ndarray:
        """(B, 3, S, S) -> (B, L, D_enc)."""
        return encode_chunks(self.session, pixels)


class LiteDecoder:
    """memory.onnx and step.onnx, and words.onnx when exported (`detects_words`)."""

    def __init__(self, memory: Any, step: Any, words: Any | None = None) -> None:
        self.memory_session, self.step_session, self.words_session = memory, step, words

    @property
    def detects_words(self) -> bool:
        return self.words_session is not None

    def word_log_probs(self, grid: np.ndarray) -> np.ndarray:
        """grid (B, L, D_enc) -> (B, V) log p(the photo shows each word), from the word detector."""
        return self.words_session.run(None, {"grid": np.ascontiguousarray(grid, np.float32)})[0]

    def memory(self, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """grid (B, L, D_enc) -> features (B, L, D), keys (B, L, A) = 2·W1·features, initial state (B, S_h)."""
        features, keys, state = self.memory_session.run(None, {"grid": np.ascontiguousarray(grid, np.float32)})
        return features, keys, state

    def step(self, tokens: np.ndarray, state: np.ndarray, features: np.ndarray,
             keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """tokens (R,) int64, state (R, S_h), features (R, L, D), keys (R, L, A) -> logits (R, V),
        alpha (R, L), new state (R, S_h)."""
        logits, alpha, new_state = self.step_session.run(None, {"tokens": tokens, "state": state,
                                                                "features": features, "keys": keys})
        return logits, alpha, new_state


@dataclass(frozen=True)
class LiteModel:
    """The graphs of one export; `model.encoder` is what the server describes on /api/model."""

    encoder: LiteEncoder
    decoder: LiteDecoder


def load_graphs(folder: Path, spec: dict[str, Any], threads: int) -> LiteModel:
    """The folder's graphs (`graph_sessions`), the encoder's on `threads`."""
    sessions = graph_sessions(folder, threads)
    return LiteModel(LiteEncoder(sessions["encoder"], spec),
                     LiteDecoder(sessions["memory"], sessions["step"], sessions.get(WORDS)))
