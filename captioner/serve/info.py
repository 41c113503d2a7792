"""What a client asks before captioning: is the server up, and what model does it serve?

    GET /api/health  liveness and what the batcher has done
    GET /api/model   encoder, grid, vocabulary size, decode defaults, training metrics, limits, examples
(No `from __future__ import annotations`: FastAPI reads the endpoints' annotations at run time.)
"""
import dataclasses

from fastapi import APIRouter, Request

from captioner.serve.deps import MAX_BEAM, MAX_LENGTH, CaptionerDep, SettingsDep
from captioner.serve.schemas import Health, ModelInfo

router = APIRouter(prefix="/api", tags=["server"])


@router.get("/health", summary="Liveness and batching figures", response_model_exclude_none=True)
async def health(request: Request) -> Health:
    batcher = getattr(request.app.state, "batcher", None)
    if batcher is None:
        return Health(status="starting")
    return Health(status="ok", **dataclasses.asdict(batcher.stats))


@router.get("/model", summary="The model being served")
async def model(captioner: CaptionerDep, settings: SettingsDep) -> ModelInfo:
    encoder, meta = captioner.model.encoder, captioner.meta
    return ModelInfo(
        checkpoint=settings.checkpoint,
        encoder=encoder.name,
        image_size=encoder.image_size,
        grid=captioner.grid,
        cells=encoder.cells._asdict(),
        vocabulary=len(captioner.vocab),
        decode=captioner.decode,
        training={k: meta[k] for k in ("epoch", "step", "metrics") if k in meta},
        limits={**dataclasses.asdict(settings.limits), "max_length": MAX_LENGTH, "max_beam": MAX_BEAM},
        examples=list(settings.examples),
    )
