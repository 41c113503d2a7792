"""What the routes depend on (`Depends`): the long-lived objects the lifespan put on `app.state`,
and a request's decode options (or the caption to score) checked against the model's defaults and
the limits.
(No `from __future__ import annotations`: FastAPI reads these annotations at run time.)
"""
import dataclasses
from pathlib import Path
from typing import Annotated

from fastapi import Depends, HTTPException, Query, Request

from captioner.decoding.captioner import Captioner
from captioner.serve.batcher import Batcher, Options
from captioner.serve.uploads import MAX_TEXT

MAX_BEAM = 10
MAX_LENGTH = 50


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may send: bytes of an upload, pixels of an image."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 50_000_000


@dataclasses.dataclass(frozen=True)
class Settings:
    """How the app serves its model: what it is called, the limits, the batching, the example images
    (name -> file; none for a model they would not suit)."""

    checkpoint: str = ""
    limits: Limits = Limits()
    max_batch: int = 16
    max_delay_ms: float = 5.0
    examples: dict[str, Path] = dataclasses.field(default_factory=dict)


def _running(request: Request, name: str) -> object:
    found = getattr(request.app.state, name, None)
    if found is None:  # only before the lifespan has started or after it has ended
        raise HTTPException(503, "the model is not being served (starting or stopping)")
    return found


def get_captioner(request: Request) -> Captioner:
    return _running(request, "captioner")  # type: ignore[return-value]


def get_batcher(request: Request) -> Batcher:
    return _running(request, "batcher")  # type: ignore[return-value]


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


CaptionerDep = Annotated[Captioner, Depends(get_captioner)]
BatcherDep = Annotated[Batcher, Depends(get_batcher)]
SettingsDep = Annotated[Settings, Depends(get_settings)]


Beam = Annotated[int | None, Query(ge=1, le=MAX_BEAM, description="beam size (1 = greedy); default: the model's")]
MaxLength = Annotated[int | None, Query(ge=1, le=MAX_LENGTH, description="most words; default: the model's")]
Alternatives = Annotated[int, Query(ge=0, lt=MAX_BEAM, description="next-best captions too")]
Text = Annotated[str | None, Query(max_length=MAX_TEXT, description="a caption to score instead of searching: "
                                   "where the model looks for each of its words and how likely it finds each "
                                   "(words it knows only; blank = none; or a form field `text`)",
                                   examples=["a dog catches a frisbee"])]


def with_text(options: Options, text: str | None) -> Options:
    """The options with a caption to score (a blank one is none), which has no alternatives."""
    if text is None or not text.strip():
        return options
    if options.alternatives:
        raise HTTPException(422, "alternatives: a caption given as text has none (nothing is searched)")
    return dataclasses.replace(options, text=text)


def decode_options(captioner: CaptionerDep, beam: Beam = None, max_length: MaxLength = None,
                   text: Text = None) -> Options:
    """A request's decode options, the model's defaults filled in."""
    return with_text(Options(beam or captioner.decode.beam_size, max_length or captioner.decode.max_length), text)


def caption_options(captioner: CaptionerDep, beam: Beam = None, max_length: MaxLength = None,
                    alternatives: Alternatives = 0, text: Text = None) -> Options:
    """The decode options and how many next-best captions (fewer than the beam's size)."""
    options = decode_options(captioner, beam, max_length)
    if alternatives >= options.beam_size:
        raise HTTPException(422, f"alternatives: {alternatives} needs a beam of at least {alternatives + 1} "
                                 f"(beam is {options.beam_size})")
    return with_text(dataclasses.replace(options, alternatives=alternatives), text)


DecodeDep = Annotated[Options, Depends(decode_options)]
CaptionDep = Annotated[Options, Depends(caption_options)]
