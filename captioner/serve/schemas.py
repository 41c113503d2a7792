"""What the API answers, as Pydantic models: the schema `/docs` and `/openapi.json` show a client.

A caption's JSON is `Caption.to_json()` (what `captioner caption --json` prints) plus what a page
needs to draw the maps: the image size, the grid, each word's focus, the time taken.
(No `from __future__ import annotations`: Pydantic and FastAPI read these annotations at run time.)
"""
from typing import Any, Literal

from pydantic import BaseModel, Field

from captioner.config import DecodeConfig


class Error(BaseModel):
    """Every error, whatever its status."""

    error: str = Field(description="one sentence: what was wrong", examples=["upload: not an image"])


class Cells(BaseModel):
    """Where the grid's cells look: cell j is centred at (origin + j * stride) x the image side."""

    origin: float
    stride: float


class Focus(BaseModel):
    peak: float = Field(description="the map's largest weight (1 = all on one cell)")
    spread: float = Field(ge=0, le=1, description="entropy / log(cells): 0 = one cell, 1 = spread evenly")


class Alternative(BaseModel):
    """A caption without its maps: the next-best captions of the beam search."""

    caption: str = Field(description="the words joined by spaces")
    tokens: list[str] = Field(description="the words, T of them")
    score: float = Field(description="length-penalised log-probability, what the beam search ranked by")
    logprob: float = Field(description="summed log-probability of the words (and of <end> when finished)")
    finished: bool = Field(description="false when cut at max_length before <end>")


class CaptionResult(Alternative):
    """A caption with every word's attention map. `alternatives` is there only when asked for, and
    `word_logprobs` only for a caption given as `text`."""

    attention: list[list[list[float]]] = Field(description="(T, rows, cols): each word's map, summing to 1")
    cells: Cells | None = Field(description="where the cells look; null = at their nominal centres")
    image_size: tuple[int, int] = Field(description="(width, height) of the photo, upright")
    grid: tuple[int, int] = Field(description="(rows, cols) of the maps")
    focus: list[Focus] = Field(description="per word: how sharply its map peaks")
    seconds: float = Field(description="time spent on the request")
    alternatives: list[Alternative] = Field(default=[], description="next-best captions (`alternatives=N`)")
    word_logprobs: list[float] = Field(default=[], description="per given word: its log-probability (`text=`)")


class Health(BaseModel):
    status: Literal["ok", "starting"]
    batches: int | None = Field(default=None, description="batches the model has run")
    images: int | None = Field(default=None, description="images it has captioned")
    largest: int | None = Field(default=None, description="the largest batch")


class Limits(BaseModel):
    max_bytes: int = Field(description="largest upload")
    max_pixels: int = Field(description="largest image, in pixels")
    max_length: int = Field(description="most words `max_length` may ask for")
    max_beam: int = Field(description="largest `beam`")


class ModelInfo(BaseModel):
    """The model being served and what a request may ask of it."""

    checkpoint: str = Field(description="the checkpoint(s) or export folder served")
    encoder: str
    image_size: int = Field(description="side of the square the encoder sees")
    grid: tuple[int, int] = Field(description="(rows, cols) of the attention maps")
    cells: Cells | None
    vocabulary: int = Field(description="words the model knows (`text=` may use only these)")
    decode: DecodeConfig = Field(description="the decode settings a request gets by default")
    training: dict[str, Any] = Field(description="epoch, step and validation metrics of the checkpoint")
    limits: Limits
    examples: list[str] = Field(description="example images that suit the model, at /examples/{name}")


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a route: each status's answer is an `Error`."""
    return {status: {"model": Error} for status in statuses}
