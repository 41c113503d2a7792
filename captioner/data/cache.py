"""On-disk feature cache: with a frozen encoder each image's grid is computed once, for every run.

Layout, in `<cache_dir>/<name>-<size>-<hash of the key>/` (cache_dir: `data.cache_dir`, default
`$CAPTIONER_CACHE/features`, shared by `prepare` and `train`):

    shard-00000.f16    raw float16 array (n, L, D), a row read with one pread when a batch needs it
    shard-00000.json   {"version", "key", "grid": [H', W'], "dim": D,
                        "images": [[absolute path, size, mtime_ns, digest], ...]}    (row i = images[i])
    shard-00001.f16 ...
    alias-00000.json   {"version", "key", "images": [[absolute path, size, mtime_ns, digest, shard, row], ...]}:
                       files whose content a row already holds (copied, moved or touched since), and
                       the digests of rows encoded before digests were kept
    failed-00000.json  {"version", "key", "images": [[absolute path, size, mtime_ns, reason], ...]}: files
                       that could not be read, skipped without another try until they change

The key (`Encoder.cache_key()`) names everything the features depend on: backbone, input size,
resize and normalisation, a digest of the weights actually loaded, and the timm and torchvision
versions. A shard is written once and never rewritten: its `.f16` first, its `.json` last (each a
temporary file renamed into place), so a shard exists exactly when its `.json` does, and a build
killed at any moment loses at most the shard it was writing. Appending images writes new shards.
An image is found by absolute path + size + mtime_ns (a stat), else by a digest of its bytes: an
edited image is encoded again (the newest shard wins) and a stale row is never served, while a data
set copied, re-extracted, moved or touched is found by content and not encoded twice (an alias file
records it, so the next run finds it by stat again). `captioner.data.cache_build` writes shards.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from captioner.config import DataConfig
from captioner.files import cache_home

log = logging.getLogger(__name__)

VERSION = 2
SHARD_GLOB = "shard-*.json"
FAILED_GLOB = "failed-*.json"

ALIAS_GLOB = "alias-*.json"

Identity = tuple[str, int, int]  # (absolute path, size in bytes, mtime_ns)
Entry = tuple[Identity, str | None]  # an image of a shard index and its content digest (None: not kept)


def image_identity(path: str | Path) -> Identity:
    """(absolute path, size, mtime_ns) of an image file; raises OSError when it cannot be stat'ed."""
    path = Path(path).expanduser().resolve()
    st = path.stat()
    return str(path), st.st_size, st.st_mtime_ns


def content_digest(path: str | Path) -> str:
    """A digest of a file's bytes (BLAKE2b, 128 bits, hex): the identity of an image's content
    wherever it lies and whatever its mtime. Raises OSError when it cannot be read."""
    return hashlib.blake2b(Path(path).read_bytes(), digest_size=16).hexdigest()


def cache_dir_of(cfg: DataConfig) -> Path:
    """Where a data section's feature caches live: `data.cache_dir`, else `$CAPTIONER_CACHE/features`,
    the same for `captioner prepare` and `captioner train`, so one encodes and the other reuses."""
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else cache_home() / "features"


def folder_name(key: str) -> str:
    """A short, file-system-safe folder for a cache key: its first two parts (backbone, size) for
    people, a hash of the whole key for uniqueness."""
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(key.split("-")[:2]))[:60]
    return f"{readable}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"


class FeatureCache:
    """Read access to one cache folder: `row(path)` -> a row index (None when absent or the file
    changed since), `get_row(row)` -> (L, D) float16. Picklable without copying the features (each
    process opens the shards it reads). A file is found by stat (`row_of`), else by content
    (`row_of_digest`).

    Rows are read with `pread`, not memory-mapped: the operating system's page cache still keeps the
    hot shards in memory, but they are not this process's memory, so a run's resident size stays that
    of one batch however large the cache (a memory map counts every page it has touched: 2.3 GB of a
    12x12 Flickr8k run's 4.2 GB)."""

    def __init__(self, folder: Path, key: str, grid: tuple[int, int], dim: int,
                 shards: list[tuple[str, list[Entry]]]) -> None:
        self.folder = Path(folder)
        self.key = key
        self.grid = (int(grid[0]), int(grid[1]))
        self.dim = int(dim)
        self._shards = [name for name, _ in shards]  # shard file stems, oldest first
        self._where: list[tuple[int, int]] = []  # global row -> (shard, row within the shard)
        self._rows: dict[str, tuple[int, int, int]] = {}  # path -> (global row, size, mtime); newest wins
        self._digests: dict[str, int] = {}  # content digest -> global row; newest wins
        self._digest_of: dict[int, str] = {}  # global row -> its content digest, where known
        for s, (_, images) in enumerate(shards):
            for r, ((path, size, mtime), digest) in enumerate(images):
                self._add((path, size, mtime), len(self._where), digest)
                self._where.append((s, r))
        self._counts = [len(images) for _, images in shards]
        self._files: dict[int, BinaryIO] = {}  # shard -> its .f16 opened for reading, in this process
        self._failed: dict[str, tuple[int, int, str]] = {}  # path -> (size, mtime, reason)

    def _add(self, ident: Identity, row: int, digest: str | None) -> None:
        self._rows[ident[0]] = (row, ident[1], ident[2])
        if digest is not None:
            self._digests[digest] = row
            self._digest_of[row] = digest

    @classmethod
    def open(cls, folder: str | Path, key: str, grid: tuple[int, int], dim: int) -> FeatureCache:
        """The shards in `folder` made with `key` (an empty cache when there are none). A shard whose
        index or size does not fit is skipped with a log line, never served."""
        folder = Path(folder)
        shards = []
        for index in sorted(folder.glob(SHARD_GLOB)):
            images = _read_shard(index, key, grid, dim)
            if images is not None:
                shards.append((index.stem, images))
        cache = cls(folder, key, grid, dim, shards)
        starts = itertools.accumulate(cache._counts, initial=0)
        span = {name: (first, count) for name, first, count in zip(cache._shards, starts, cache._counts)}
        for record in sorted(folder.glob(ALIAS_GLOB)):
            try:
                meta = json.loads(record.read_text())
                if meta.get("version") != VERSION or meta.get("key") != key:
                    continue
                for path, size, mtime, digest, shard, r in meta["images"]:
                    first, count = span.get(shard, (0, 0))  # a shard skipped as unreadable has no rows
                    if 0 <= int(r) < count:
                        row = first + int(r)
                        if row >= cache._rows.get(path, (-1,))[0]:  # an alias never hides a newer encoding
                            cache._add((str(path), int(size), int(mtime)), row, str(digest))
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("%s: ignoring an unreadable record of cached images", record)
        for record in sorted(folder.glob(FAILED_GLOB)):
            try:
                meta = json.loads(record.read_text())
                if meta.get("version") == VERSION and meta.get("key") == key:
                    cache._failed.update({p: (int(s), int(m), str(r)) for p, s, m, r in meta["images"]})
            except (OSError, ValueError, KeyError, TypeError):
                log.warning("%s: ignoring an unreadable record of failed images", record)
        return cache

    def failure(self, ident: Identity) -> str | None:
        """Why this exact file (same size and mtime) could not be read last time, or None."""
        hit = self._failed.get(ident[0])
        return hit[2] if hit is not None and hit[:2] == ident[1:] else None

    @property
    def length(self) -> int:
        """L = H'·W', regions per image."""
        return self.grid[0] * self.grid[1]

    def __len__(self) -> int:
        """Images with a row (each image once, its newest row)."""
        return len(self._rows)

    @property
    def shards(self) -> int:
        return len(self._shards)

    def row(self, path: str | Path) -> int | None:
        """The row holding `path`'s features (found by stat, else by content), or None when absent or
        the file changed since."""
        try:
            ident = image_identity(path)
            row = self.row_of(ident)
            return row if row is not None or not self._digests else self.row_of_digest(content_digest(ident[0]))
        except OSError:
            return None

    def row_of(self, ident: Identity) -> int | None:
        """The row of this exact file (path, size and mtime as encoded or aliased), or None."""
        hit = self._rows.get(ident[0])
        return hit[0] if hit is not None and hit[1:] == ident[1:] else None

    def row_of_digest(self, digest: str) -> int | None:
        """The newest row encoded from a file with these bytes, or None."""
        return self._digests.get(digest)

    def digest_of(self, row: int) -> str | None:
        """The content digest of row `row`, or None when it was encoded before digests were kept."""
        return self._digest_of.get(row)

    def locate(self, row: int) -> tuple[str, int]:
        """(shard file stem, row within the shard) of global row `row`: what an alias records."""
        shard, r = self._where[row]
        return self._shards[shard], r

    def __contains__(self, path: object) -> bool:
        return isinstance(path, (str, Path)) and self.row(path) is not None

    def get_row(self, row: int) -> np.ndarray:
        """(L, D) float16 features of row `row` (see `row`), a new array."""
        shard, r = self._where[row]
        if shard not in self._files:
            self._files[shard] = open(self.folder / f"{self._shards[shard]}.f16", "rb", buffering=0)
        out = np.empty((self.length, self.dim), dtype=np.float16)  # (L, D)
        if os.preadv(self._files[shard].fileno(), [out], r * out.nbytes) != out.nbytes:
            raise OSError(f"{self.folder / self._shards[shard]}.f16: shorter than its index says (truncated?)")
        return out

    def get(self, path: str | Path) -> np.ndarray:
        """(L, D) float16 features of `path`; KeyError when not cached or changed since."""
        row = self.row(path)
        if row is None:
            raise KeyError(f"{path}: not in the feature cache {self.folder} (or changed since)")
        return self.get_row(row)

    @property
    def nbytes(self) -> int:
        """Size of the shards on disk, in bytes."""
        return sum(self._counts) * self.length * self.dim * 2

    @property
    def superseded(self) -> int:
        """Rows no longer served: an image encoded again after its file changed (edited, or copied
        anew with a new mtime) left its old row behind in a shard that is never rewritten."""
        return len(self._where) - len({row for row, _, _ in self._rows.values()})

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_files"] = {}  # open files stay in their process; another opens its own
        return state

    def __repr__(self) -> str:
        return f"FeatureCache({self.folder}, {len(self)} images in {self.shards} shards, grid {self.grid}, dim {self.dim})"


def _read_shard(index: Path, key: str, grid: tuple[int, int], dim: int) -> list[Entry] | None:
    """A shard's images and their digests, or None (logged) when it is unreadable or not of this cache."""
    try:
        meta = json.loads(index.read_text())
        images = [((str(e[0]), int(e[1]), int(e[2])), str(e[3]) if len(e) > 3 else None) for e in meta["images"]]
        fits = (meta.get("version") == VERSION and meta["key"] == key and tuple(meta["grid"]) == tuple(grid)
                and int(meta["dim"]) == dim)
        size = index.with_suffix(".f16").stat().st_size
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("%s: ignoring an unreadable cache shard (%s)", index, e)
        return None
    if not fits or size != len(images) * grid[0] * grid[1] * dim * 2:
        log.warning("%s: ignoring a cache shard that does not match its key or size", index)
        return None
    return images
