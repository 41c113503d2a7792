"""Reading an uploaded image into memory: a multipart form's `image` field (and its optional `text`
field: a caption to score), or the raw body.

The size limit holds before anything large is read: a Content-Length over it is refused at once, and
a body sent without one (chunked) is cut off as soon as it passes the limit. Nothing goes to disk
(Starlette's own form parser spools uploads over 1 MB to a temporary file).

A client that goes away in the middle of its upload is one line in the log (no traceback: nothing
is wrong with the server), and its request ends there.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

from fastapi import HTTPException, Request
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect

log = logging.getLogger(__name__)

FIELD, TEXT = "image", "text"
MAX_TEXT = 300  # characters of a caption to score: a long sentence
# nginx's status for a client that closed its connection; nobody is left to read the answer.
CLIENT_CLOSED = 499


def _too_large(limit: int) -> HTTPException:
    return HTTPException(413, f"upload is larger than the {limit / 2**20:.3g} MB allowed (--max-mb)")


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most `limit` bytes (HTTP 413 beyond)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        log.warning("%s went away during its upload to %s (%d of %s bytes sent)", client, request.url.path, size,
                    length or "?")
        raise HTTPException(CLIENT_CLOSED, "the client went away during its upload") from None
    return b"".join(chunks)


class Upload(NamedTuple):
    image: bytes
    text: str | None = None  # the form's `text` field, when it has one


def form_fields(body: bytes, content_type: str) -> dict[str, bytes]:
    """The fields of a multipart/form-data body, name -> bytes (the first of a name); HTTP 422 when malformed."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise HTTPException(422, "multipart body without a boundary")
    parts: dict[str, bytes] = {}
    current: dict[str, object] = {}

    def on_header_field(data: bytes, start: int, end: int) -> None:
        current["field"] = current.get("field", b"") + data[start:end]  # type: ignore[operator]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        current["value"] = current.get("value", b"") + data[start:end]  # type: ignore[operator]

    def on_header_end() -> None:
        if bytes(current.pop("field", b"")).lower() == b"content-disposition":  # type: ignore[arg-type]
            _, disposition = parse_options_header(bytes(current.get("value", b"")))  # type: ignore[arg-type]
            current["name"] = disposition.get(b"name", b"").decode("utf-8", "replace")
        current.pop("value", None)

    def on_part_begin() -> None:
        current.clear()
        current["data"] = bytearray()

    def on_part_data(data: bytes, start: int, end: int) -> None:
        current["data"] += data[start:end]  # type: ignore[operator]

    def on_part_end() -> None:
        parts.setdefault(str(current.get("name", "")), bytes(current["data"]))  # type: ignore[arg-type]

    parser = MultipartParser(boundary, {
        "on_header_field": on_header_field, "on_header_value": on_header_value, "on_header_end": on_header_end,
        "on_part_begin": on_part_begin, "on_part_data": on_part_data, "on_part_end": on_part_end})
    try:
        parser.write(body)
        parser.finalize()
    except Exception as e:  # python-multipart's errors for a malformed body
        raise HTTPException(422, f"malformed multipart body ({type(e).__name__})") from None
    return parts


def text_field(data: bytes) -> str:
    """A form's text field as a string (HTTP 422 unless short UTF-8)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise HTTPException(422, f"{TEXT}: not UTF-8 text") from None
    if len(text) > MAX_TEXT:
        raise HTTPException(422, f"{TEXT}: {len(text)} characters, at most {MAX_TEXT} allowed")
    return text


async def read_upload(request: Request, limit: int) -> Upload:
    """The image bytes of a request: the `image` field of a multipart form (with its `text` field), else
    the whole body."""
    body = await read_body(request, limit)
    content_type = request.headers.get("content-type", "")
    if not content_type.lower().startswith("multipart/form-data"):
        return Upload(body)
    parts = form_fields(body, content_type)
    if FIELD not in parts:
        raise HTTPException(422, f"multipart body without an '{FIELD}' field (fields: {', '.join(parts) or 'none'})")
    return Upload(parts[FIELD], text_field(parts[TEXT]) if TEXT in parts else None)
