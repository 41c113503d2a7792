"""Reading image files into RGB PIL images, with one-line errors that name the file.

Pillow's decompression-bomb guard stays on and truncated files are errors (the whole image is
decoded here with `.load()`, `ImageFile.LOAD_TRUNCATED_IMAGES` is left False).
"""
from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from captioner.errors import CaptionerError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")  # what a folder's images are
_ALPHA_MODES = {"RGBA", "LA", "PA", "RGBa", "La"}
_WHITE = (255, 255, 255)


def is_image_file(path: Path) -> bool:
    """Whether `path` is a file named as an image (`IMAGE_SUFFIXES`, any case): what a folder given
    for its images contributes."""
    return path.suffix.lower() in IMAGE_SUFFIXES and path.is_file()


class ImageError(CaptionerError):
    """An image file that is missing or cannot be decoded: message "PATH: reason"."""


class NotAnImage(ImageError):
    """Data in no image format Pillow knows."""


class ImageTooLarge(ImageError):
    """More pixels than allowed (a possible decompression bomb)."""


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}" if text else type(e).__name__


FULL_SIZE = "captioner_full_size"  # image.info key: (w, h) of the upright image before draft decoding


def full_size(image: Image.Image) -> tuple[int, int]:
    """(w, h) of the photo as it is on disk (upright), also when `load_image(draft=...)` decoded less."""
    return image.info.get(FULL_SIZE, image.size)


def load_image(path: str | Path, draft: int | None = None) -> Image.Image:
    """Decode `path` fully and return an RGB image, EXIF orientation applied.

    Grayscale, palette, alpha (composited on white), CMYK and 16/32-bit integer images all
    become 8-bit RGB. Raises ImageError for a missing, empty, truncated or non-image file.

    `draft`: the side the image will be resized to. A JPEG is then decoded at the smallest DCT
    scale (1/2, 1/4, 1/8) that still leaves both sides at least `draft` pixels (Pillow's draft
    mode: less to decode and less to resize); `full_size(image)` still gives the photo's size.
    """
    path = Path(path)
    if path.is_dir():
        raise ImageError(f"{path}: is a folder, not an image file")
    with _reading(path):
        if path.exists() and not path.is_file():  # a pipe (/dev/stdin, <(curl ...)): read once, from memory
            data = path.read_bytes()
            if not data:
                raise ImageError(f"{path}: nothing to read")
            with Image.open(io.BytesIO(data)) as im:
                return _decoded(im, path, draft)
        if path.stat().st_size == 0:
            raise ImageError(f"{path}: empty file")
        with Image.open(path) as im:
            return _decoded(im, path, draft)


def photo_size(path: str | Path) -> tuple[int, int]:
    """(w, h) of the photo upright (EXIF orientation applied), from its header alone. Raises ImageError."""
    with _reading(path), Image.open(path) as im:
        return _upright(im)


def decode_image(data: bytes, name: str = "<image>", max_pixels: int = 50_000_000,
                 draft: int | None = None) -> Image.Image:
    """Image file bytes (an upload) -> RGB image, exactly as `load_image` reads a file (`draft` too),
    from memory only. Raises NotAnImage, ImageTooLarge (more than `max_pixels`, checked from the
    header before anything is decoded) or ImageError (truncated, corrupt), each naming `name`."""
    if not data:
        raise NotAnImage(f"{name}: empty upload")
    with _reading(name), Image.open(io.BytesIO(data)) as im:
        if im.width * im.height > max_pixels:
            raise ImageTooLarge(f"{name}: {im.width}x{im.height} pixels is more than the {max_pixels:,} allowed")
        return _decoded(im, name, draft)


def _decoded(im: Image.Image, name: Path | str, draft: int | None) -> Image.Image:
    """An opened image decoded (a JPEG at the DCT scale `draft` allows) to upright 8-bit RGB, its
    photo's own size kept as `full_size`."""
    size = _upright(im)
    if draft and im.format == "JPEG":
        im.draft("RGB", (draft, draft))
    im.load()  # decode everything now: truncated data fails here, not later
    rgb = to_rgb(_exif_transpose(im, name))
    rgb.info[FULL_SIZE] = size
    return rgb


@contextmanager
def _reading(name: Path | str) -> Iterator[None]:
    """Pillow's and the file system's errors while reading an image, as one-line ImageErrors naming it."""
    try:
        yield
    except ImageError:
        raise
    except FileNotFoundError:
        raise ImageError(f"{name}: file not found") from None
    except PermissionError:
        raise ImageError(f"{name}: permission denied") from None
    except UnidentifiedImageError:
        raise NotAnImage(f"{name}: not an image (format not recognised)") from None
    except Image.DecompressionBombError as e:
        raise ImageTooLarge(f"{name}: refused as a possible decompression bomb ({_reason(e)})") from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError) as e:
        # Pillow raises these for truncated or corrupt data ("image file is truncated", ...)
        raise ImageError(f"{name}: truncated or corrupt image ({_reason(e)})") from None


def prepare_image(image: Image.Image, name: str = "<image>") -> Image.Image:
    """An image given in memory made exactly what `load_image` makes of a file: decoded, EXIF
    orientation applied, any mode converted to 8-bit RGB. The caller's image is left as it was.
    Raises ImageError (naming `name`) when its data cannot be decoded."""
    with _reading(name):
        image.load()
        return to_rgb(_exif_transpose(image.copy(), name))


def _upright(im: Image.Image) -> tuple[int, int]:
    """(w, h) once EXIF orientation is applied (orientations 5-8 swap the sides)."""
    try:
        turned = im.getexif().get(0x0112, 1) in (5, 6, 7, 8)
    except Exception:  # a broken EXIF block: exif_transpose will ignore it too
        turned = False
    return (im.height, im.width) if turned else (im.width, im.height)


def _exif_transpose(im: Image.Image, path: Path | str) -> Image.Image:
    try:
        ImageOps.exif_transpose(im, in_place=True)  # no copy when there is nothing to rotate
        return im
    except Exception as e:  # a broken EXIF block should not cost the image
        log.debug("%s: ignoring unreadable EXIF orientation (%s)", path, _reason(e))
        return im


def to_rgb(im: Image.Image) -> Image.Image:
    """Any Pillow mode -> 8-bit RGB (alpha composited on white, high bit depths rescaled)."""
    mode = im.mode
    if mode == "RGB":
        return im
    if mode in _ALPHA_MODES or (mode in ("P", "L") and "transparency" in im.info):
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, _WHITE + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if mode.startswith("I") or mode == "F":
        return _high_depth_to_rgb(im)
    return im.convert("RGB")  # L, 1, P, CMYK, YCbCr, ...


def _high_depth_to_rgb(im: Image.Image) -> Image.Image:
    """16-bit ("I;16*"), 32-bit int ("I") and float ("F") grayscale -> RGB by scaling, not clipping."""
    arr = np.asarray(im).astype(np.float64)
    if im.mode.startswith("I;16"):
        top = 65535.0
    elif im.mode == "F" and arr.size and float(arr.max()) <= 1.0:
        top = 1.0
    else:  # "I" (e.g. a 16-bit PNG) or "F": choose the smallest usual range that holds the data
        peak = float(arr.max()) if arr.size else 0.0
        top = 255.0 if peak <= 255 else 65535.0 if peak <= 65535 else peak
    gray = np.clip(arr / top * 255.0 + 0.5, 0, 255).astype(np.uint8)
    return Image.fromarray(gray).convert("RGB")
