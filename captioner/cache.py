"""On-disk feature cache: with a frozen encoder each image's grid is computed once.

Layout, in `<cache_dir>/<encoder.cache_key()>/`:

    features.f16   raw float16 array (N, L, D), read with np.memmap
    index.json     {"version", "key", "shape": [N, L, D], "grid": [H', W'],
                    "images": [[absolute path, size, mtime_ns], ...]}   (row i = images[i])

An image is identified by absolute path + size + mtime_ns, so an edited image is recomputed and
a stale row is never served. A build writes a new features file under a temporary name and then
publishes it: index.json removed, features renamed into place, the new index written last (temp +
rename). A build killed at any point leaves either the old cache, or no index (ignored, rebuilt).
Concurrent builds of one folder (e.g. several DDP ranks) are serialised with a file lock.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from captioner.encoder import Encoder
from captioner.images import ImageError, load_image
from captioner.sources import Record

log = logging.getLogger(__name__)

VERSION = 1
INDEX = "index.json"
FEATURES = "features.f16"
_COPY_CHUNK = 512  # rows copied at a time from an old cache into a new one

Identity = tuple[str, int, int]  # (absolute path, size in bytes, mtime_ns)


def image_identity(path: str | Path) -> Identity:
    """(absolute path, size, mtime_ns) of an image file; raises OSError when it cannot be stat'ed."""
    path = Path(path).expanduser().resolve()
    st = path.stat()
    return str(path), st.st_size, st.st_mtime_ns


def folder_name(key: str) -> str:
    """A file-system-safe folder name for a cache key (hash suffix when characters were replaced)."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", key)[:80]
    return safe if safe == key else f"{safe}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"


class FeatureCache:
    """Read access to one cache folder. `get(path) -> (L, D) float16` for a cached, unchanged image.

    Picklable without copying the features (the memmap is reopened lazily in each process).
    """

    def __init__(self, folder: Path, key: str, grid: tuple[int, int], dim: int, images: list[Identity]) -> None:
        self.folder = Path(folder)
        self.key = key
        self.grid = (int(grid[0]), int(grid[1]))
        self.dim = int(dim)
        self._rows = {p: (row, size, mtime) for row, (p, size, mtime) in enumerate(images)}
        self._images = list(images)
        self._features: np.ndarray | None = None

    # --- opening ------------------------------------------------------------------------------
    @classmethod
    def open(cls, folder: str | Path, key: str | None = None) -> FeatureCache | None:
        """The cache in `folder`, or None when it is missing, for another key, or inconsistent."""
        folder = Path(folder)
        try:
            index = json.loads((folder / INDEX).read_text())
            n, length, dim = (int(x) for x in index["shape"])
            grid = tuple(int(x) for x in index["grid"])
            images = [(str(p), int(s), int(m)) for p, s, m in index["images"]]
            ok = (index.get("version") == VERSION and (key is None or index["key"] == key)
                  and len(images) == n and grid[0] * grid[1] == length
                  and (folder / FEATURES).stat().st_size == n * length * dim * 2)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.info("%s: ignoring an unreadable feature cache (%s)", folder, e)
            return None
        if not ok:
            log.info("%s: ignoring a feature cache that does not match (key, version or size)", folder)
            return None
        return cls(folder, index["key"], grid, dim, images)  # type: ignore[arg-type]

    # --- reading ------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """L = H'·W', regions per image."""
        return self.grid[0] * self.grid[1]

    @property
    def features(self) -> np.ndarray:
        """All rows, (N, L, D) float16 (a read-only memmap)."""
        if self._features is None:
            shape = (len(self._images), self.length, self.dim)
            if shape[0] == 0:
                self._features = np.zeros(shape, np.float16)
            else:
                self._features = np.memmap(self.folder / FEATURES, dtype=np.float16, mode="r", shape=shape)
        return self._features

    def __len__(self) -> int:
        return len(self._images)

    def row(self, path: str | Path) -> int | None:
        """The row holding `path`'s features, or None when absent or the file changed since."""
        try:
            p, size, mtime = image_identity(path)
        except OSError:
            return None
        hit = self._rows.get(p)
        return hit[0] if hit is not None and hit[1:] == (size, mtime) else None

    def _row_of(self, ident: Identity) -> int | None:
        hit = self._rows.get(ident[0])
        return hit[0] if hit is not None and hit[1:] == ident[1:] else None

    def __contains__(self, path: object) -> bool:
        return isinstance(path, (str, Path)) and self.row(path) is not None

    def get(self, path: str | Path) -> np.ndarray:
        """(L, D) float16 features of `path`; KeyError when not cached or changed since."""
        row = self.row(path)
        if row is None:
            raise KeyError(f"{path}: not in the feature cache {self.folder} (or changed since)")
        return self.features[row]

    def get_row(self, row: int) -> np.ndarray:
        """(L, D) float16 features of row `row` (see `row`)."""
        return self.features[row]

    @property
    def nbytes(self) -> int:
        """Size of the features file in bytes."""
        return len(self._images) * self.length * self.dim * 2

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_features"] = None  # never pickle the memmap (that would copy all features)
        return state

    def __repr__(self) -> str:
        return f"FeatureCache({self.folder}, {len(self)} images, grid {self.grid}, dim {self.dim})"


@dataclass
class CacheResult:
    """What `build_cache` did: the cache, images computed now, images reused, images skipped."""

    cache: FeatureCache
    built: int
    reused: int
    skipped: list[tuple[Path, str]] = field(default_factory=list)


# --- building --------------------------------------------------------------------------------


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
    encoder: Encoder,
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


def _build_locked(paths: list[Path], encoder: Encoder, key: str, folder: Path, batch_size: int,
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
           keep: list[tuple[int, Identity]], todo: list[tuple[Path, Identity]], encoder: Encoder,
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
                 encoder: Encoder, batch_size: int, device: torch.device, num_workers: int, progress: bool,
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
