"""The FastAPI app around one `Captioner`: its routers, its lifespan, its error handlers.

    POST /api/caption    an image -> its caption with every word's map        (api.py)
    POST /api/visualize  an image -> the attention picture (PNG)              (api.py)
    GET  /api/health     liveness and batching figures                        (info.py)
    GET  /api/model      the model, its decode defaults, the limits           (info.py)
    GET  /               the page; /examples/{name} its example images        (page.py)
    GET  /docs           the OpenAPI docs of all the above (/openapi.json)

The model is loaded before the app is made (so a bad checkpoint is one line at the command line);
the lifespan starts its `Batcher` (the model's one thread) and puts both on `app.state`, where the
routes reach them through `Depends`; it stops the batcher, after the queued requests, at shutdown.
Every error is JSON `{"error": "one sentence"}` with its status (errors.py).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline

from captioner.decoding.captioner import Captioner
from captioner.serve import api, info, page
from captioner.serve.batcher import Batcher
from captioner.serve.deps import Limits, Settings
from captioner.serve.errors import add_error_handlers

__all__ = ["Limits", "Settings", "create_app"]


def create_app(captioner: Captioner, checkpoint: str = "", limits: Limits = Limits(), max_batch: int = 16,
               max_delay_ms: float = 5.0, examples: dict[str, Path] | None = None) -> FastAPI:
    """The app serving `captioner`. `examples` (name -> image file, `page.examples_for`) are offered
    on the page; none by default."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        with Batcher(captioner, max_batch, max_delay_ms) as batcher:
            app.state.captioner, app.state.batcher = captioner, batcher
            try:
                yield
            finally:
                app.state.captioner = app.state.batcher = None

    # FastAPIOffline: /docs and /redoc from files shipped with the package, not a CDN (works offline)
    app = FastAPIOffline(title="captioner", summary="Captions, and where the model looked for every word.",
                         lifespan=lifespan)
    app.state.settings = Settings(checkpoint, limits, max_batch, max_delay_ms, dict(examples or {}))
    add_error_handlers(app)
    app.include_router(api.router)
    app.include_router(info.router)
    app.include_router(page.router)
    app.mount("/static", StaticFiles(directory=page.STATIC), name="static")
    return app
