"""The page and the example images offered on it.

    GET /                 the page (static/index.html; its script and stylesheet under /static)
    GET /examples/{name}  one of the example images `/api/model` lists

The examples must suit the model: the built-in drawn shapes for a model trained on the shapes set,
a folder the user names (`captioner serve --examples DIR`), or none: a photo model is not offered
drawn shapes. Only the files listed at start are served; no path from a client is ever opened.
(No `from __future__ import annotations`: FastAPI reads the endpoints' annotations at run time.)
"""
from importlib import resources
from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

from captioner.serve.deps import SettingsDep
from captioner.serve.schemas import error_responses

STATIC = Path(str(resources.files("captioner.serve") / "static"))
SHAPES = STATIC / "examples"  # drawn by captioner.data.shapes, for a model of the built-in shapes set
SHOWN_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")  # what every browser shows in an <img> (not TIFF)
MAX_EXAMPLES = 12

router = APIRouter(include_in_schema=False)


def list_examples(folder: Path | None) -> dict[str, Path]:
    """name -> file of the first MAX_EXAMPLES images of `folder` by name (none for None)."""
    if folder is None:
        return {}
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in SHOWN_SUFFIXES and p.is_file())
    return {p.name: p for p in files[:MAX_EXAMPLES]}


def examples_for(trained_on: str, folder: Path | None = None) -> dict[str, Path]:
    """The examples to offer: `folder`'s images when given, the built-in shapes for a model trained on
    them (its config's data.path is "shapes"), else none."""
    if folder is not None:
        return list_examples(folder)
    return list_examples(SHAPES) if trained_on == "shapes" else {}


@router.get("/")
async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html")


@router.get("/examples/{name}", responses=error_responses(404))
async def example(name: str, settings: SettingsDep) -> FileResponse:
    path = settings.examples.get(name)
    if path is None:
        raise HTTPException(404, f"no example image {name!r}")
    return FileResponse(path)
