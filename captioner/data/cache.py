"""On-disk feature cache: with a frozen encoder each image's grid is computed once.

Layout, in `<cache_dir>/<encoder.cache_key()>/`:

    features.f16   raw float16 array (N, L, D), read with np.memmap
    index.json     {"version", "key", "shape": [N, L, D], "grid": [H', W'],
                    "images": [[absolute path, size, mtime_ns], ...]}   (row i = images[i])

An image is identified by absolute path + size + mtime_ns, so an edited image is recomputed and
a stale row is never served. `captioner.data.cache_build` fills the cache.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

VERSION = 1
INDEX = "index.json"
FEATURES = "features.f16"


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
