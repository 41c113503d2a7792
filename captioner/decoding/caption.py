"""`Caption`: what `Captioner.caption` returns for an image: the words, their scores, where the model
looked for each, and the JSON that `captioner caption --json` prints and the server answers with.

Shapes: T words, H' x W' the encoder's grid.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from captioner.model.grid import Cells


@dataclass
class Caption:
    """A generated (or given, `caption(text=)`) caption and where the model looked for each word.

    text: the words joined by spaces.
    tokens: the words (T of them).
    score: length-penalised log-probability (what beam search ranked by).
    logprob: summed log-probability of the words (and of <end> when finished).
    attention: (T, H', W') float32, each word's map over the encoder grid, summing to 1.
    image_size: (width, height) of the captioned image.
    path: the image file, when the image came from one.
    alternatives: the next best captions of the beam search, best first (`alternatives=` of `caption`).
    word_logprobs: each word's log-probability, for a caption given as `text` (teacher-forced); logprob
        is their sum plus <end>'s. None for a searched caption.
    finished: False when the caption was cut at max_length without <end>.
    cells: where the grid's cells look (`Encoder.cells`: centre of cell j at (origin + j * stride)
        x the image side); the pictures and the grounding score place each weight there.
        None = at the nominal centres (j + 0.5) / n.
    """

    text: str
    tokens: list[str]
    score: float
    logprob: float
    attention: np.ndarray
    image_size: tuple[int, int]
    path: str | None = None
    finished: bool = True
    cells: Cells | None = None
    alternatives: list[Caption] = dataclasses.field(default_factory=list)
    word_logprobs: list[float] | None = None

    def to_json(self, attention: bool = True) -> dict[str, Any]:
        """Plain JSON-ready dict; `attention` as nested lists, one (H', W') grid per word; the
        alternatives (when asked for) as caption, tokens, score, logprob and finished."""
        row: dict[str, Any] = {"path": self.path, "caption": self.text, "tokens": self.tokens,
                               "score": self.score, "logprob": self.logprob, "finished": self.finished,
                               "word_logprobs": self.word_logprobs}
        if attention:
            row["attention"] = self.attention.tolist()
            row["cells"] = None if self.cells is None else self.cells._asdict()
        if self.alternatives:
            row["alternatives"] = [{k: v for k, v in a.to_json(attention=False).items()
                                    if k not in ("path", "word_logprobs")} for a in self.alternatives]
        return row
