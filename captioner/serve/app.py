"""The HTTP API and the page: a FastAPI app around one `Captioner` and its `Batcher`.

    POST /api/caption   an image (multipart field `image`, or the raw bytes) -> the caption JSON of
                        `captioner caption --json`, with every word's map, its focus, alternatives
    GET  /api/health    liveness and what the batcher has done
    GET  /api/model     encoder, grid, vocabulary size, decode defaults, training metrics, limits
    GET  /              the page (captioner/serve/static), /docs the OpenAPI docs

Every error is JSON `{"error": "one sentence"}` with its status: 413 too many bytes or pixels,
415 not an image, 422 bad options or a corrupt image. Uploads are read into memory (never a
file), up to `max_bytes`; no path from a client is ever opened.
(No `from __future__ import annotations`: FastAPI reads the endpoints' annotations at run time.)
"""
import dataclasses
import io
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import PIL.Image
import torch
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from captioner.data.images import ImageError, ImageTooLarge, NotAnImage, decode_image
from captioner.decoding.captioner import Caption, Captioner
from captioner.pictures.figures import attention_figure
from captioner.pictures.overlay import word_focus
from captioner.serve.batcher import Batcher, Options
from captioner.serve.uploads import read_upload

STATIC = Path(str(resources.files("captioner.serve") / "static"))
MAX_BEAM = 10


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one request may ask: bytes of an upload, pixels of an image, the longest caption."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 50_000_000
    max_length: int = 50


def caption_json(caption: Caption, seconds: float) -> dict[str, Any]:
    """`Caption.to_json()` (what `captioner caption --json` prints) plus what a client needs to draw
    the maps: the image size, the grid, each word's focus (peak weight, spread 0..1)."""
    row = caption.to_json()
    del row["path"]  # an upload has none
    rows, cols = caption.attention.shape[1:]
    row["image_size"] = list(caption.image_size)
    row["grid"] = [int(rows), int(cols)]
    row["focus"] = [dict(zip(("peak", "spread"), word_focus(m))) for m in caption.attention]
    row["seconds"] = round(seconds, 4)
    return row


def _picture(image: PIL.Image.Image, caption: Caption) -> bytes:
    """`captioner visualize`'s PNG, in memory."""
    buffer = io.BytesIO()
    attention_figure(image, caption).savefig(buffer, format="png", facecolor="white")
    return buffer.getvalue()


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def create_app(captioner: Captioner, checkpoint: str = "", limits: Limits = Limits(), max_batch: int = 16,
               max_delay_ms: float = 5.0) -> FastAPI:
    """The app; its Batcher (one model thread) starts and stops with the app's lifespan."""
    state: dict[str, Batcher] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        with Batcher(captioner, max_batch, max_delay_ms) as batcher:
            state["batcher"] = batcher
            yield
        state.clear()

    app = FastAPI(title="captioner", summary="Captions, and where the model looked for every word.",
                  lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def bad_options(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "request"
        given = f" (got {first['input']!r})" if isinstance(first.get("input"), (str, int, float)) else ""
        return _error(422, f"{where}: {first.get('msg', 'invalid')}{given}")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    defaults = captioner.decode

    def prepare(data: bytes) -> tuple[PIL.Image.Image, torch.Tensor]:
        """On a request thread: the upload decoded (ImageError subclasses for the client) and preprocessed."""
        image = decode_image(data, "upload", limits.max_pixels)
        return image, captioner.preprocess(image)

    upload_body = {"requestBody": {"required": True, "content": {
        "multipart/form-data": {"schema": {"type": "object", "required": ["image"], "properties": {
            "image": {"type": "string", "format": "binary"}}}},
        "image/*": {"schema": {"type": "string", "format": "binary"}}}}}

    async def captioned(request: Request, beam: int | None, max_length: int | None,
                        alternatives: int) -> tuple[PIL.Image.Image, Caption] | JSONResponse:
        """The request's image and its caption, or the JSON error to answer instead."""
        options = Options(beam or defaults.beam_size, max_length or defaults.max_length, alternatives)
        if options.alternatives >= options.beam_size:
            return _error(422, f"alternatives: {alternatives} needs a beam of at least {alternatives + 1} "
                               f"(beam is {options.beam_size})")
        data = await read_upload(request, limits.max_bytes)
        try:
            image, pixels = await run_in_threadpool(prepare, data)
        except ImageTooLarge as e:
            return _error(413, str(e))
        except NotAnImage as e:
            return _error(415, str(e))
        except ImageError as e:
            return _error(422, str(e))
        return image, await state["batcher"].caption(pixels, options, image.size)

    Beam = Annotated[int | None, Query(ge=1, le=MAX_BEAM, description="beam size (1 = greedy)")]
    MaxLength = Annotated[int | None, Query(ge=1, le=limits.max_length, description="most words")]
    Alternatives = Annotated[int, Query(ge=0, lt=MAX_BEAM, description="next-best captions too")]

    @app.post("/api/caption", summary="Caption one image", openapi_extra=upload_body)
    async def caption(request: Request, beam: Beam = None, max_length: MaxLength = None,
                      alternatives: Alternatives = 0) -> JSONResponse:
        """The caption of an image sent as a multipart field `image` or as the raw body, with the
        attention map of every word (rows x cols, summing to 1) and `alternatives` next-best captions."""
        tick = time.perf_counter()
        answer = await captioned(request, beam, max_length, alternatives)
        if isinstance(answer, JSONResponse):
            return answer
        return JSONResponse(caption_json(answer[1], time.perf_counter() - tick))

    @app.post("/api/visualize", summary="The attention picture of one image (PNG)", openapi_extra=upload_body,
              response_class=Response, responses={200: {"content": {"image/png": {}}}})
    async def visualize(request: Request, beam: Beam = None, max_length: MaxLength = None) -> Response:
        """The picture `captioner visualize` draws: the photo, then every word's map on one colour scale."""
        answer = await captioned(request, beam, max_length, 0)
        if isinstance(answer, JSONResponse):
            return answer
        png = await run_in_threadpool(_picture, *answer)
        return Response(png, media_type="image/png")

    @app.get("/api/health", summary="Liveness and batching figures")
    async def health() -> dict[str, Any]:
        batcher = state.get("batcher")
        return {"status": "ok" if batcher else "starting",
                **({} if batcher is None else dataclasses.asdict(batcher.stats))}

    @app.get("/api/model", summary="The model being served")
    async def model() -> dict[str, Any]:
        encoder = captioner.model.encoder
        meta = captioner.meta
        return {
            "checkpoint": checkpoint,
            "encoder": encoder.name,
            "image_size": encoder.image_size,
            "grid": list(captioner.grid),
            "cells": encoder.cells._asdict(),
            "vocabulary": len(captioner.vocab),
            "decode": dataclasses.asdict(defaults),
            "training": {k: meta[k] for k in ("epoch", "step", "metrics") if k in meta},
            "limits": {**dataclasses.asdict(limits), "max_beam": MAX_BEAM},
            "examples": sorted(p.name for p in (STATIC / "examples").glob("*.png")),
        }

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app

