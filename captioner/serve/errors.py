"""Every error as JSON `{"error": "one sentence"}` with its status, nothing as plain text.

The routes raise `HTTPException`; `json_error` shapes those and FastAPI's request validation errors
(a bad query option: 422 naming the option, the rule and the value given). `unexpected` is the
catch-all: a bug or a failure nobody foresaw answers 500 in the same JSON (Starlette would answer
"Internal Server Error" as plain text) and its traceback goes to the server's log (uvicorn logs it,
as the exception then reaches it).
"""
from __future__ import annotations

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from captioner.data.images import ImageError, ImageTooLarge, NotAnImage


def image_error(e: ImageError) -> HTTPException:
    """An upload that is no usable image: 413 too many pixels, 415 not an image, 422 corrupt."""
    status = 413 if isinstance(e, ImageTooLarge) else 415 if isinstance(e, NotAnImage) else 422
    return HTTPException(status, str(e))


def validation_message(exc: RequestValidationError) -> str:
    """The first problem as one sentence, e.g. "beam: Input should be greater than or equal to 1 (got '0')"."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "request"
    given = f" (got {first['input']!r})" if isinstance(first.get("input"), (str, int, float)) else ""
    return f"{where}: {first.get('msg', 'invalid')}{given}"


async def json_error(request: Request, exc: Exception) -> JSONResponse:
    """HTTPException (ours, and Starlette's 404 / 405) and validation errors, as JSON."""
    if isinstance(exc, RequestValidationError):
        return JSONResponse({"error": validation_message(exc)}, status_code=422)
    assert isinstance(exc, StarletteHTTPException)
    return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)


async def unexpected(request: Request, exc: Exception) -> JSONResponse:
    """Anything else: a JSON 500 that names the kind of failure, not its internals."""
    return JSONResponse({"error": f"the server failed on this request ({type(exc).__name__}); its log has the "
                                  f"details"}, status_code=500)


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(StarletteHTTPException, json_error)
    app.add_exception_handler(RequestValidationError, json_error)
    app.add_exception_handler(Exception, unexpected)
