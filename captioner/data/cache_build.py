"""Filling the feature cache (`captioner.data.cache`): encode the images that are not cached yet.

`build_cache(records, encoder, cache_dir)` reuses every valid row (a file whose stat changed is
matched by the digest of its bytes, and recorded in an alias file), encodes missing or changed
images into new shards (never rewriting one), and skips (and lists) unreadable ones. Shards are
published one by one as they fill, so a build killed with SIGKILL keeps every finished shard for
the next run. The next build removes what a killed one left half-written. Concurrent builds of
one folder (several DDP ranks, `prepare` next to `train`) take turns through a file lock.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from captioner.data.cache import (ALIAS_GLOB, FAILED_GLOB, SHARD_GLOB, VERSION, Entry, FeatureCache, Identity,
                                  content_digest, folder_name, image_identity)
from captioner.data.images import ImageError, load_image
from captioner.data.records import Record
from captioner.files import atomic_write_text, naming_write_errors, remove_stale_temporaries

log = logging.getLogger(__name__)

SHARD_BYTES = 64 << 20  # a shard holds about this much: a kill costs at most one shard of work


class GridEncoder(Protocol):
    """What the cache needs of an encoder (`captioner.model.encoder.Encoder` is one): a frozen
    module mapping (B, 3, S, S) images to (B, L, D) grids, its preprocessing and its identity."""

    frozen: bool
    grid: tuple[int, int]
    out_dim: int
    training: bool

    def infer(self, images: torch.Tensor) -> torch.Tensor: ...
    def transform(self, train: bool = False) -> Callable: ...
    def cache_key(self) -> str: ...
    def parameters(self) -> Iterator[torch.nn.Parameter]: ...
    def to(self, device: torch.device) -> Any: ...
    def eval(self) -> Any: ...
    def train(self, mode: bool = True) -> Any: ...


@dataclass
class CacheResult:
    """What `build_cache` did: the cache, images encoded now, images found cached, images skipped."""

    cache: FeatureCache
    built: int
    reused: int
    skipped: list[tuple[Path, str]] = field(default_factory=list)


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

    Valid rows are reused; missing or changed images are encoded (eval transform, inference mode,
    on `device`) into new shards; unreadable or missing files are logged and listed in `skipped`.
    The encoder must be frozen; it is returned to its device and train/eval mode afterwards.
    """
    if not encoder.frozen:
        raise ValueError("build_cache needs a frozen encoder (model.encoder.trainable_stages=0)")
    key = encoder.cache_key()
    grid, dim = tuple(encoder.grid), int(encoder.out_dim)
    folder = Path(cache_dir).expanduser() / folder_name(key)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder):
        removed = remove_stale_temporaries(folder)  # a killed build's half-written shard
        for orphan in folder.glob("shard-*.f16"):  # killed between publishing a shard's features and its index
            if not orphan.with_suffix(".json").exists():
                orphan.unlink()
                removed += 1
        if removed:
            log.info("%s: removed %d files a killed build left", folder, removed)
        old = FeatureCache.open(folder, key, grid, dim)
        todo, reused, aliases, skipped = _plan(_paths_of(items), old)
        if aliases:
            _write_aliases(folder, key, old, aliases)
        built, failed = 0, []
        if todo:
            built, failed = _encode(folder, key, grid, dim, len(old._shards), todo, encoder, batch_size,
                                    torch.device(device), num_workers, progress)
        cache = FeatureCache.open(folder, key, grid, dim) if todo or aliases else old
    skipped += failed
    moved = sum(1 for ident, _, row in aliases if old.row_of(ident) != row)
    log.info("%s: %d images encoded, %d reused%s, %d skipped", folder, built, reused,
             f" ({moved} found by content: copied, moved or touched since they were encoded)" if moved else "",
             len(skipped))
    if built and cache.superseded:
        stale = cache.superseded * cache.length * cache.dim * 2 / 2**30
        log.warning("%s: %d rows (%.1f GB) belong to images that changed since they were encoded and are never "
                    "read again; delete the folder when no run is using it to reclaim the space", folder,
                    cache.superseded, stale)
    return CacheResult(cache, built, reused, skipped)


def _paths_of(items: Iterable[Record | str | Path]) -> list[Path]:
    seen: dict[Path, None] = {}
    for it in items:
        seen.setdefault(Path(it.image if isinstance(it, Record) else it), None)
    return list(seen)


def _plan(paths: list[Path], cache: FeatureCache) -> tuple[list[tuple[Path, Entry]], int, list[tuple[Identity, str, int]],
                                                          list[tuple[Path, str]]]:
    """(images to encode with their digests, images already cached, aliases to record, images that
    cannot be read). An image is cached when its stat matches a row's, or else its bytes' digest
    does (an alias then records its new stat); a stat-matched row without a digest gets one."""
    todo, skipped, aliases, reused, seen = [], [], [], 0, set()
    for p in paths:
        try:
            ident = image_identity(p)
            if ident[0] in seen:  # the same file under another spelling of its path
                continue
            seen.add(ident[0])
            row = cache.row_of(ident)
            if row is None and (reason := cache.failure(ident)) is not None:  # unreadable last time, unchanged since
                skipped.append((p, reason))
                continue
            digest = cache.digest_of(row) if row is not None else None
            if digest is None:
                digest = content_digest(ident[0])
                row = cache.row_of_digest(digest) if row is None else row
                if row is not None:
                    aliases.append((ident, digest, row))
        except FileNotFoundError:
            skipped.append((p, "file not found"))
            continue
        except OSError as e:
            skipped.append((p, f"cannot read ({e.strerror})"))
            continue
        if row is not None:
            reused += 1
        else:
            todo.append((p, (ident, digest)))
    for p, reason in skipped:
        log.warning("%s: skipped (%s)", p, reason)
    return todo, reused, aliases, skipped


def _write_aliases(folder: Path, key: str, cache: FeatureCache, aliases: list[tuple[Identity, str, int]]) -> None:
    """Record that these files' contents are in these rows (written once, never rewritten)."""
    number = max([int(p.stem.split("-")[1]) + 1 for p in folder.glob(ALIAS_GLOB)], default=0)
    images = [[*ident, digest, *cache.locate(row)] for ident, digest, row in aliases]
    atomic_write_text(folder / f"alias-{number:05d}.json", json.dumps({"version": VERSION, "key": key, "images": images}))


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


class _ShardWriter:
    """Appends encoded rows to numbered shards, publishing each when it is full (and the last at the end)."""

    def __init__(self, folder: Path, key: str, grid: tuple[int, int], dim: int, first: int) -> None:
        self.folder, self.key, self.grid, self.dim = folder, key, grid, dim
        self.per_shard = max(1, SHARD_BYTES // (grid[0] * grid[1] * dim * 2))
        self.number = first
        self.file: IO[bytes] | None = None
        self.images: list[Entry] = []

    def add(self, features: np.ndarray, identities: list[Entry]) -> None:
        """(n, L, D) float16 rows of the images `identities` (with their digests), in order."""
        done = 0
        while done < len(identities):
            if self.file is None:
                self.file = open(self._path(".f16", temporary=True), "wb")
            take = min(self.per_shard - len(self.images), len(identities) - done)
            with naming_write_errors(self._path(".f16")):
                self.file.write(np.ascontiguousarray(features[done: done + take]).tobytes())
            self.images += identities[done: done + take]
            done += take
            if len(self.images) == self.per_shard:
                self.publish()

    def publish(self) -> None:
        """The current shard's features renamed into place, then its index: from now on it exists."""
        if self.file is None:
            return
        with naming_write_errors(self._path(".f16")):
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
        os.replace(self._path(".f16", temporary=True), self._path(".f16"))
        index = {"version": VERSION, "key": self.key, "grid": list(self.grid), "dim": self.dim,
                 "images": [[*ident, digest] for ident, digest in self.images]}
        atomic_write_text(self._path(".json"), json.dumps(index))
        self.file, self.images, self.number = None, [], self.number + 1

    def _path(self, suffix: str, temporary: bool = False) -> Path:
        name = f"shard-{self.number:05d}{suffix}"
        return self.folder / (f".{name}.{os.getpid()}.tmp" if temporary else name)


def _encode(folder: Path, key: str, grid: tuple[int, int], dim: int, existing: int,
            todo: list[tuple[Path, Entry]], encoder: GridEncoder, batch_size: int, device: torch.device,
            num_workers: int, progress: bool) -> tuple[int, list[tuple[Path, str]]]:
    """Encode `todo` into new shards after the `existing` ones. Returns (encoded, skipped)."""
    shard_no = max([int(p.stem.split("-")[1]) + 1 for p in folder.glob(SHARD_GLOB)], default=existing)
    writer = _ShardWriter(folder, key, grid, dim, shard_no)
    loader = DataLoader(_ImageFiles([p for p, _ in todo], encoder.transform(train=False)), batch_size=batch_size,
                        num_workers=num_workers, collate_fn=_collate_items, pin_memory=device.type == "cuda")
    first = next(encoder.parameters(), None)
    home, was_training = (first.device if first is not None else torch.device("cpu")), encoder.training
    encoder.to(device).eval()
    failed: list[tuple[Path, str]] = []
    built = 0
    try:
        with tqdm(total=len(todo), desc="encoding images", unit="img", disable=not progress, leave=False) as bar:
            for ok, batch, bad in loader:
                for i, reason in bad:
                    log.warning("%s: skipped (%s)", todo[i][0], reason)
                    failed.append((todo[i][0], reason))
                if batch is not None:
                    feats = encoder.infer(batch.to(device, non_blocking=True))  # (B, L, D), chunked on a CPU
                    writer.add(feats.float().cpu().numpy().astype(np.float16), [todo[i][1] for i in ok])
                    built += len(ok)
                bar.update(len(ok) + len(bad))
        writer.publish()
        if failed:
            number = len(list(folder.glob(FAILED_GLOB)))
            bad = {str(p): reason for p, reason in failed}
            images = [[*ident, bad[str(p)]] for p, (ident, _) in todo if str(p) in bad]
            atomic_write_text(folder / f"failed-{number:05d}.json", json.dumps({"version": VERSION, "key": key,
                                                                                 "images": images}))
    finally:
        if writer.file is not None:  # interrupted: the unfinished shard is dropped (finished ones stay)
            writer.file.close()
            writer._path(".f16", temporary=True).unlink(missing_ok=True)
        encoder.to(home).train(was_training)
    return built, failed
