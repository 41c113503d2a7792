"""The captioning endpoints: an image in, its caption with every word's map (JSON), or the picture.

    POST /api/caption    -> CaptionResult, what `captioner caption --json` prints plus what a page needs
    POST /api/visualize  -> the PNG `captioner visualize` draws

The image is a multipart field `image` or the raw body, read into memory (never a file) up to the
byte limit, decoded and preprocessed on a request thread, then captioned in a batch on the model's
thread (`Batcher`). With `text` (a query parameter or a form field) the caption is not searched for:
the model reads the given words, and answers where it looked for each and how likely it found each
(`word_logprobs`). Errors: 413 too many bytes or pixels, 415 not an image, 422 bad options, words
the model does not know or a corrupt image, 500 the model failed.
(No `from __future__ import annotations`: FastAPI reads the endpoints' annotations at run time.)
"""
import io
import time

import PIL.Image
import torch
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from captioner.data.images import ImageError, decode_image, full_size
from captioner.decoding.captioner import Caption, Captioner
from captioner.errors import CaptionerError
from captioner.pictures.figures import attention_figure
from captioner.pictures.overlay import word_focus
from captioner.serve.batcher import Batcher, Options
from captioner.serve.deps import BatcherDep, CaptionDep, CaptionerDep, DecodeDep, Limits, SettingsDep, with_text
from captioner.serve.errors import image_error
from captioner.serve.schemas import CaptionResult, error_responses
from captioner.serve.uploads import MAX_TEXT, read_upload

router = APIRouter(prefix="/api", tags=["captions"], responses=error_responses(413, 415, 422, 500))

# An upload is read by hand (`read_upload`, under the byte limit), so the body is described here.
UPLOAD = {"requestBody": {"required": True, "content": {
    "multipart/form-data": {"schema": {"type": "object", "required": ["image"], "properties": {
        "image": {"type": "string", "format": "binary"},
        "text": {"type": "string", "maxLength": MAX_TEXT, "description": "as the `text` query parameter"}}}},
    "image/*": {"schema": {"type": "string", "format": "binary"}}}}}


def caption_result(caption: Caption, seconds: float) -> CaptionResult:
    """`Caption.to_json()` (less the path: an upload has none) and the image size, the grid, each
    word's focus. Fields left out (no alternatives asked for, no text given) stay unset: not in the JSON."""
    row = caption.to_json()
    del row["path"]
    if row.get("word_logprobs") is None:  # a searched caption
        row.pop("word_logprobs", None)
    rows, cols = caption.attention.shape[1:]
    focus = [dict(zip(("peak", "spread"), word_focus(m))) for m in caption.attention]
    return CaptionResult(**row, image_size=caption.image_size, grid=(int(rows), int(cols)), focus=focus,
                         seconds=round(seconds, 4))


def _prepare(captioner: Captioner, data: bytes, max_pixels: int) -> tuple[PIL.Image.Image, torch.Tensor]:
    """On a request thread: the upload in full (for pictures) and its pixels preprocessed as
    `captioner caption FILE` reads that file (a large JPEG at a reduced scale), for the same caption."""
    seen = decode_image(data, "upload", max_pixels, draft=captioner.image_side)
    image = seen if seen.size == full_size(seen) else decode_image(data, "upload", max_pixels)
    return image, captioner.preprocess(seen)


async def _captioned(request: Request, options: Options, captioner: Captioner, batcher: Batcher,
                     limits: Limits) -> tuple[PIL.Image.Image, Caption]:
    """The request's image and its caption; HTTPException for a bad upload, words the model does not
    know, or a failed model."""
    upload = await read_upload(request, limits.max_bytes)
    if upload.text is not None:
        if options.text is not None:
            raise HTTPException(422, "text: given twice (as a query parameter and a form field)")
        options = with_text(options, upload.text)
    try:
        image, pixels = await run_in_threadpool(_prepare, captioner, upload.image, limits.max_pixels)
    except ImageError as e:
        raise image_error(e) from None
    try:
        return image, await batcher.caption(pixels, options, image.size)
    except CaptionerError as e:  # the text's words: one sentence naming those the model does not know
        raise HTTPException(422, str(e)) from None
    except Exception as e:  # the batcher has logged the traceback
        raise HTTPException(500, f"the model failed on this image ({type(e).__name__})") from None


def _picture(image: PIL.Image.Image, caption: Caption) -> bytes:
    """`captioner visualize`'s PNG, in memory."""
    buffer = io.BytesIO()
    attention_figure(image, caption).savefig(buffer, format="png", facecolor="white")
    return buffer.getvalue()


@router.post("/caption", summary="Caption one image", openapi_extra=UPLOAD, response_model_exclude_unset=True)
async def caption(request: Request, options: CaptionDep, captioner: CaptionerDep, batcher: BatcherDep,
                  settings: SettingsDep) -> CaptionResult:
    """The caption of an image sent as a multipart field `image` or as the raw body, with the
    attention map of every word (rows x cols, summing to 1) and `alternatives` next-best captions;
    or, given `text`, those words with their maps and `word_logprobs`."""
    tick = time.perf_counter()
    _, result = await _captioned(request, options, captioner, batcher, settings.limits)
    return caption_result(result, time.perf_counter() - tick)


@router.post("/visualize", summary="The attention picture of one image (PNG)", openapi_extra=UPLOAD,
             response_class=Response, responses={200: {"content": {"image/png": {}}}})
async def visualize(request: Request, options: DecodeDep, captioner: CaptionerDep, batcher: BatcherDep,
                    settings: SettingsDep) -> Response:
    """The picture `captioner visualize` draws: the photo, then every word's map on one colour scale
    (of the given `text`'s words, when given)."""
    image, result = await _captioned(request, options, captioner, batcher, settings.limits)
    return Response(await run_in_threadpool(_picture, image, result), media_type="image/png")
