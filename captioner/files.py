"""Writing files safely: output paths checked before the work starts, results written atomically.

An output is written to a temporary file in its own folder, flushed to disk and renamed over the
target, so a crash, a full disk or a Ctrl-C never leaves half a file where a good one was.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

from captioner.errors import WRITE_ERRORS, CaptionerError


def cache_home() -> Path:
    """Where captioner keeps what it can recompute (feature caches, the shapes set):
    `$CAPTIONER_CACHE`, else `~/.cache/captioner`."""
    return Path(os.environ.get("CAPTIONER_CACHE") or "~/.cache/captioner").expanduser()


def _reason(e: OSError) -> str:
    return e.strerror or type(e).__name__


def writable_dir(path: str | Path, what: str = "folder") -> Path:
    """Make sure `path` is a folder this process can write into (creating it and its parents); a
    one-line CaptionerError names it otherwise."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise CaptionerError(f"{path}: is a file, not a {what}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as e:
        raise CaptionerError(f"{path}: cannot write here ({_reason(e)})") from None
    return path


def writable_file(path: str | Path, what: str = "output", inputs: Iterable[str | Path] = ()) -> Path:
    """Make sure `path` can be written (its folder exists or can be made, and is writable; the path
    is not a folder, a device or a pipe, nor one of the command's `inputs`), before the work that
    produces it starts."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise CaptionerError(f"{path}: is a folder; give a file name for the {what}")
    if path.exists() and not path.is_file():
        raise CaptionerError(f"{path}: is not a regular file (a device or a pipe); give a file name for the {what}")
    for source in inputs:
        with contextlib.suppress(OSError):
            if path.exists() and os.path.samefile(path, source):
                raise CaptionerError(f"{path}: is one of the command's inputs; give another file name for the {what}")
    writable_dir(path.parent if str(path.parent) else Path("."))
    if path.exists() and not os.access(path, os.W_OK):
        raise CaptionerError(f"{path}: cannot write here (permission denied)")
    return path


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file beside `path` for writing; on success it is fsynced and renamed over
    `path`, on any failure (exceptions, KeyboardInterrupt) removed, leaving `path` as it was."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # what open() would have made: mkstemp's 0600 hides a shared model from others
    try:
        with naming_write_errors(path), os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def naming_write_errors(path: str | Path) -> Iterator[None]:
    """A full or failing disk while writing `path`: the system's OSError names no file; re-raised naming it."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno in WRITE_ERRORS:
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def atomic_write_text(path: str | Path, text: str) -> Path:
    with atomic_open(path) as f:
        f.write(text)
    return Path(path)


@contextlib.contextmanager
def staged_files(folder: str | Path, last: str | None = None) -> Iterator[Path]:
    """A hidden temporary folder beside `folder` to write a set of files into; when the block
    succeeds they move into `folder` (replacing files of the same names; the one named `last` moved
    after the others, say the manifest that says the rest is complete). On any failure nothing in
    `folder` has changed. The temporary folder is removed either way."""
    folder = Path(folder)
    stage = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", suffix=".tmp", dir=folder.parent))
    try:
        with naming_write_errors(folder):
            yield stage
        for f in sorted(stage.iterdir(), key=lambda f: f.name == last):
            os.replace(f, folder / f.name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def remove_stale_temporaries(folder: str | Path, pattern: str = ".*.tmp") -> int:
    """Delete temporary files a killed writer left in `folder` (callers hold the folder: no live
    writer can be using them). Returns how many were removed."""
    removed = 0
    for stale in Path(folder).glob(pattern):
        with contextlib.suppress(OSError):
            stale.unlink()
            removed += 1
    return removed
