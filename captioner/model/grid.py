"""The encoder's grid as inference needs it, without torch: where its cells look (`Cells`) and how
many images a CPU encodes per call (`CPU_CHUNK`). `captioner.model.encoder` re-exports both; the
torch-free ONNX runtime (`captioner.deploy.lite`) and the pictures read them from here."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

CPU_CHUNK = 2  # images per CNN call on a CPU (see `Encoder.infer`)


class Cells(NamedTuple):
    """Where the grid's cells look, as fractions of the image side: cell j's receptive field is
    centred at (origin + j * stride) x width (columns) or x height (rows). The encoder squashes the
    whole image into its square input, so the same fractions hold for the original photo."""

    origin: float
    stride: float

    def centres(self, n: int, side: float) -> np.ndarray:
        """(n,) pixel centres of n cells along a side of `side` pixels."""
        return (self.origin + self.stride * np.arange(n)) * side
