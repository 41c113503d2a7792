"""Filling the feature cache (`captioner.data.cache`): encode the images that are not cached yet.

`build_cache(records, encoder, cache_dir)` reuses every valid row, encodes missing or changed
images, and skips (and lists) unreadable ones. A build writes a new features file under a temporary
name and then publishes it: index.json removed, features renamed into place, the new index written
last (temp + rename). A build killed at any point leaves either the old cache, or no index (ignored,
rebuilt). Concurrent builds of one folder (e.g. several DDP ranks) are serialised with a file lock.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from captioner.data.cache import FEATURES, INDEX, VERSION, FeatureCache, Identity, folder_name, image_identity
from captioner.data.images import ImageError, load_image
from captioner.data.records import Record

log = logging.getLogger(__name__)

_COPY_CHUNK = 512  # rows copied at a time from an old cache into a new one


class GridEncoder(Protocol):
    """What the cache needs of an encoder (`captioner.model.encoder.Encoder` is one): a frozen
    module mapping (B, 3, S, S) images to (B, L, D) grids, its preprocessing and its identity."""

    frozen: bool
    grid: tuple[int, int]
    out_dim: int
    training: bool

    def __call__(self, images: torch.Tensor) -> torch.Tensor: ...
    def transform(self, train: bool = False) -> Callable: ...
    def cache_key(self) -> str: ...
    def parameters(self) -> Iterator[torch.nn.Parameter]: ...
    def to(self, device: torch.device) -> Any: ...
    def eval(self) -> Any: ...
    def train(self, mode: bool = True) -> Any: ...


@dataclass
class CacheResult:
    """What `build_cache` did: the cache, images computed now, images reused, images skipped."""

    cache: FeatureCache
    built: int
    reused: int
    skipped: list[tuple[Path, str]] = field(default_factory=list)


class _Item(NamedTuple):
    index: int
    image: torch.Tensor | None  # (3, S, S), or None when it failed
    reason: str


class _ImageFiles(Dataset):
    """Images for the encoder; a file that fails yields its reason instead of raising."""

    def __init__(self, paths: list[Path], transform: Callable) -> None:
        self.paths, self.transform = paths, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> _Item:
        try:
            return _Item(i, self.transform(load_image(self.paths[i])), "")
        except ImageError as e:
            return _Item(i, None, str(e).split(": ", 1)[-1])
        except Exception as e:  # a transform failing on one odd image must not stop the build
            return _Item(i, None, f"{type(e).__name__}: {e}")


def _collate_items(items: list[_Item]) -> tuple[list[int], torch.Tensor | None, list[tuple[int, str]]]:
    ok = [it for it in items if it.image is not None]
    images = torch.stack([it.image for it in ok]) if ok else None  # (B, 3, S, S)
    return [it.index for it in ok], images, [(it.index, it.reason) for it in items if it.image is None]


def _paths_of(items: Iterable[Record | str | Path]) -> list[Path]:
    seen: dict[Path, None] = {}
    for it in items:
        seen.setdefault(Path(it.image if isinstance(it, Record) else it), None)
    return list(seen)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive lock on `folder/.lock` (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(folder / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_cache(
    items: Iterable[Record | str | Path],
    encoder: GridEncoder,
    cache_dir: str | Path,
    batch_size: int = 32,
    device: str | torch.device = "cpu",
    num_workers: int = 0,
    progress: bool = True,
) -> CacheResult:
    """Make sure every image of `items` (records or paths) has its grid in the cache.

    Valid rows are reused; missing or changed images are encoded (eval transform, inference
    mode, on `device`); unreadable or missing files are logged and listed in `skipped`. Valid
    rows of other images already in the cache are kept. The encoder must be frozen; it is
    returned to its device and train/eval mode afterwards.
    """
    if not encoder.frozen:
        raise ValueError("build_cache needs a frozen encoder (model.encoder.trainable_stages=0)")
    key = encoder.cache_key()
    folder = Path(cache_dir).expanduser() / folder_name(key)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder):
        return _build_locked(_paths_of(items), encoder, key, folder, batch_size, torch.device(device), num_workers,
                             progress)


def _build_locked(paths: list[Path], encoder: GridEncoder, key: str, folder: Path, batch_size: int,
                  device: torch.device, num_workers: int, progress: bool) -> CacheResult:
    grid, dim = tuple(encoder.grid), int(encoder.out_dim)
    old = FeatureCache.open(folder, key)
    if old is not None and (old.grid != grid or old.dim != dim):
        old = None
    skipped: list[tuple[Path, str]] = []
    todo: list[tuple[Path, Identity]] = []
    reused = 0
    seen: set[str] = set()
    for p in paths:
        try:
            ident = image_identity(p)
        except FileNotFoundError:
            skipped.append((p, "file not found"))
            continue
        except OSError as e:
            skipped.append((p, f"cannot read ({e.strerror})"))
            continue
        if ident[0] in seen:  # the same file under another spelling of its path
            continue
        seen.add(ident[0])
        if old is not None and old._row_of(ident) is not None:
            reused += 1
        else:
            todo.append((p, ident))
    for p, reason in skipped:
        log.warning("%s: skipped (%s)", p, reason)
    if old is not None and not todo:
        log.info("%s: all %d images cached", folder, reused)
        return CacheResult(old, 0, reused, skipped)

    keep = _still_valid(old) if old is not None else []
    cache, built, failed = _write(folder, key, grid, dim, old, keep, todo, encoder, batch_size, device,
                                  num_workers, progress)
    skipped += failed
    log.info("%s: %d images encoded, %d reused, %d skipped", folder, built, reused, len(skipped))
    return CacheResult(cache, built, reused, skipped)


def _still_valid(old: FeatureCache) -> list[tuple[int, Identity]]:
    """Rows of `old` whose image file is unchanged (stat'ed again)."""
    keep = []
    for row, ident in enumerate(old._images):
        try:
            if image_identity(ident[0]) == ident:
                keep.append((row, ident))
        except OSError:
            pass
    return keep


def _write(folder: Path, key: str, grid: tuple[int, int], dim: int, old: FeatureCache | None,
           keep: list[tuple[int, Identity]], todo: list[tuple[Path, Identity]], encoder: GridEncoder,
           batch_size: int, device: torch.device, num_workers: int, progress: bool,
           ) -> tuple[FeatureCache, int, list[tuple[Path, str]]]:
    """Kept rows + newly encoded images into a new features file, then publish it."""
    length = grid[0] * grid[1]
    tmp = folder / f"features.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    capacity = len(keep) + len(todo)
    images: list[Identity] = []
    failed: list[tuple[Path, str]] = []
    try:
        if capacity == 0:
            tmp.write_bytes(b"")
        else:
            out = np.memmap(tmp, dtype=np.float16, mode="w+", shape=(capacity, length, dim))
            for i in range(0, len(keep), _COPY_CHUNK):
                chunk = keep[i: i + _COPY_CHUNK]
                out[i: i + len(chunk)] = old.features[[row for row, _ in chunk]]  # type: ignore[union-attr]
                images += [ident for _, ident in chunk]
            failed = _encode_into(out, len(images), todo, images, encoder, batch_size, device, num_workers, progress)
            out.flush()
            del out
            os.truncate(tmp, len(images) * length * dim * 2)  # drop the rows of images that failed
        (folder / INDEX).unlink(missing_ok=True)  # from here until the new index: no cache (ignored)
        os.replace(tmp, folder / FEATURES)
    finally:
        tmp.unlink(missing_ok=True)
    index = {"version": VERSION, "key": key, "shape": [len(images), length, dim], "grid": list(grid),
             "images": [list(ident) for ident in images]}
    tmp_index = folder / f"{INDEX}.{os.getpid()}.tmp"
    tmp_index.write_text(json.dumps(index))
    os.replace(tmp_index, folder / INDEX)
    return FeatureCache(folder, key, grid, dim, images), len(images) - len(keep), failed


def _encode_into(out: np.ndarray, start: int, todo: list[tuple[Path, Identity]], images: list[Identity],
                 encoder: GridEncoder, batch_size: int, device: torch.device, num_workers: int, progress: bool,
                 ) -> list[tuple[Path, str]]:
    """Encode `todo` images into rows `start...` of `out`, appending their identities to `images`."""
    loader = DataLoader(_ImageFiles([p for p, _ in todo], encoder.transform(train=False)), batch_size=batch_size,
                        num_workers=num_workers, collate_fn=_collate_items, pin_memory=device.type == "cuda")
    first = next(encoder.parameters(), None)
    home, was_training = (first.device if first is not None else torch.device("cpu")), encoder.training
    encoder.to(device).eval()
    failed: list[tuple[Path, str]] = []
    row = start
    try:
        with torch.inference_mode(), tqdm(total=len(todo), desc="encoding images", unit="img",
                                          disable=not progress, leave=False) as bar:
            for ok, batch, bad in loader:
                for i, reason in bad:
                    log.warning("%s: skipped (%s)", todo[i][0], reason)
                    failed.append((todo[i][0], reason))
                if batch is not None:
                    feats = encoder(batch.to(device, non_blocking=True))  # (B, L, D)
                    out[row: row + len(ok)] = feats.float().cpu().numpy().astype(np.float16)
                    images += [todo[i][1] for i in ok]
                    row += len(ok)
                bar.update(len(ok) + len(bad))
    finally:
        encoder.to(home).train(was_training)
    return failed
