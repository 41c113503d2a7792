"""Feature cache: computed once, reused while valid, re-encoded when the encoder or an image changes,
broken and missing images skipped and counted; shards never rewritten, a killed build resumed."""
import io
import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from captioner.config import EncoderConfig
from captioner.data.cache import FeatureCache
from captioner.data.cache_build import build_cache
from captioner.data.images import load_image
from captioner.data.records import Record
from captioner.model.encoder import build_encoder


@pytest.fixture(scope="module")
def encoder():
    return build_encoder(EncoderConfig(name="random", image_size=64))


class Counting:
    """Counts images passed through an encoder's forward."""

    def __init__(self, enc, monkeypatch):
        self.n = 0
        forward = enc.forward

        def counted(images):
            self.n += images.shape[0]
            return forward(images)
        monkeypatch.setattr(enc, "forward", counted)


def _good(folder: Path, n: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        p = folder / f"img{i}.png"
        Image.new("RGB", (40 + 7 * i, 30), (30 * i % 255, 80, 160)).save(p)
        paths.append(p)
    return paths


def _broken(folder: Path) -> dict[Path, str]:
    buf = io.BytesIO()
    Image.effect_noise((64, 64), 60).convert("RGB").save(buf, format="JPEG", quality=95)
    (folder / "truncated.jpg").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    (folder / "text.jpg").write_text("hello, I am not a JPEG")
    (folder / "empty.jpg").write_bytes(b"")
    return {folder / "truncated.jpg": "truncated", folder / "text.jpg": "not an image",
            folder / "empty.jpg": "empty", folder / "missing.jpg": "not found"}


def test_build_skips_broken_and_missing_images_and_stores_the_grid(tmp_path, encoder, monkeypatch):
    good = _good(tmp_path / "img", 5)
    broken = _broken(tmp_path / "img")
    counter = Counting(encoder, monkeypatch)
    records = [Record(p, ("a caption",), "train") for p in good + list(broken)]
    result = build_cache(records + records[:2], encoder, tmp_path / "cache", batch_size=2, progress=False)
    assert (result.built, result.reused) == (5, 0) and counter.n == 5
    assert {p: r for p, r in result.skipped}.keys() == broken.keys()
    for path, reason in result.skipped:
        assert broken[path] in reason
    cache = result.cache
    assert cache.grid == encoder.grid and cache.dim == encoder.out_dim and len(cache) == 5
    feats = cache.get(good[3])
    assert feats.shape == (16, encoder.out_dim) and feats.dtype == np.float16
    with torch.inference_mode():
        expected = encoder(encoder.transform()(load_image(good[3]))[None])[0].numpy()
    np.testing.assert_allclose(feats.astype(np.float32), expected, rtol=1e-2, atol=1e-2)
    assert good[0] in cache and tmp_path / "img" / "text.jpg" not in cache
    on_disk = sum(p.stat().st_size for p in cache.folder.glob("shard-*.f16"))
    assert on_disk == cache.nbytes == 5 * 16 * encoder.out_dim * 2


def test_valid_cache_is_reused_without_recompute(tmp_path, encoder, monkeypatch):
    good = _good(tmp_path / "img", 4)
    build_cache(good, encoder, tmp_path / "cache", progress=False)
    counter = Counting(encoder, monkeypatch)
    result = build_cache(good, encoder, tmp_path / "cache", progress=False)
    assert (result.built, result.reused, counter.n) == (0, 4, 0)
    again = FeatureCache.open(result.cache.folder, encoder.cache_key(), encoder.grid, encoder.out_dim)
    np.testing.assert_array_equal(again.get(good[1]), result.cache.get(good[1]))


def test_a_full_disk_while_caching_names_the_cache_folder(tmp_path, encoder, monkeypatch):
    import errno

    good = _good(tmp_path / "img", 3)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as e:
        build_cache(good, encoder, tmp_path / "cache", progress=False)
    assert e.value.errno == errno.ENOSPC and str(tmp_path / "cache") in e.value.filename


def test_rows_are_read_into_memory_of_their_own_not_mapped(tmp_path, encoder):
    """A row is a new array read from its shard, never a view of a memory map: a map keeps every page
    it touched in the process's resident memory, which would grow to the whole cache over an epoch."""
    good = _good(tmp_path / "img", 3)
    cache = build_cache(good, encoder, tmp_path / "cache", progress=False).cache
    rows = [cache.get(p) for p in good]
    assert all(type(r) is np.ndarray and r.base is None and r.flags.writeable for r in rows)
    stored = np.fromfile(next(cache.folder.glob("shard-*.f16")), dtype=np.float16).reshape(3, 16, -1)
    np.testing.assert_array_equal(np.stack(rows), stored)
    shard = next(cache.folder.glob("shard-*.f16"))
    shard.write_bytes(shard.read_bytes()[: stored[0].nbytes])  # cut short after the cache was opened
    fresh = pickle.loads(pickle.dumps(cache))  # another process's copy opens the shard itself
    np.testing.assert_array_equal(fresh.get(good[0]), stored[0])
    with pytest.raises(OSError, match=rf"{shard.name}: shorter than its index says"):
        fresh.get(good[2])


def test_changed_image_is_recomputed_and_stale_rows_never_served(tmp_path, encoder, monkeypatch, caplog):
    good = _good(tmp_path / "img", 4)
    first = build_cache(good, encoder, tmp_path / "cache", progress=False).cache
    before = first.get(good[2]).copy()
    Image.new("RGB", (50, 50), (255, 255, 0)).save(good[2])  # new content
    st = good[2].stat()
    os.utime(good[2], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert good[2] not in first  # the old cache refuses to serve the stale row
    counter = Counting(encoder, monkeypatch)
    result = build_cache(good, encoder, tmp_path / "cache", progress=False)
    assert (result.built, result.reused, counter.n) == (1, 3, 1)
    assert not np.array_equal(result.cache.get(good[2]), before)
    np.testing.assert_array_equal(result.cache.get(good[0]), first.get(good[0]))
    os.utime(good[1])  # touched only: found by its content, not encoded again
    again = build_cache(good, encoder, tmp_path / "cache", progress=False)
    assert (again.built, again.reused, counter.n) == (0, 4, 1) and again.cache.superseded == 1  # the old row of 2
    np.testing.assert_array_equal(again.cache.get(good[1]), first.get(good[1]))
    good[3].write_bytes(good[3].read_bytes())  # rewritten with the same bytes: still the same content
    good[0].write_bytes(good[0].read_bytes()[:-1] + b"x")  # same size, other bytes: encoded again
    with caplog.at_level(logging.WARNING, logger="captioner.data.cache_build"):
        last = build_cache(good, encoder, tmp_path / "cache", progress=False)
    assert (last.built, counter.n) == (1, 2) and last.cache.superseded == 2
    assert "2 rows (0.0 GB) belong to images that changed" in caplog.text


def test_a_copied_touched_or_moved_data_set_is_found_by_content(tmp_path, encoder, monkeypatch, caplog):
    """Re-extracting or copying a data set gives every photo a new mtime or path: its rows are found
    by the digest of the bytes, recorded in an alias file, and the next run finds them by stat alone."""
    import captioner.data.cache as cache_module
    import captioner.data.cache_build as build_module

    good = _good(tmp_path / "img", 3)
    first = build_cache(good, encoder, tmp_path / "cache", progress=False)
    moved = tmp_path / "copy"
    shutil.copytree(tmp_path / "img", moved)  # new paths, new mtimes
    copies = [moved / p.name for p in good]
    counter = Counting(encoder, monkeypatch)
    with caplog.at_level(logging.INFO, logger="captioner.data.cache_build"):
        result = build_cache(copies, encoder, tmp_path / "cache", progress=False)
    assert (result.built, result.reused, counter.n) == (0, 3, 0) and result.cache.superseded == 0
    assert "3 found by content" in caplog.text and len(list(first.cache.folder.glob("alias-*.json"))) == 1
    for p, q in zip(good, copies):
        np.testing.assert_array_equal(result.cache.get(q), first.cache.get(p))
    hashed = []
    real = cache_module.content_digest
    monkeypatch.setattr(build_module, "content_digest", lambda p: hashed.append(p) or real(p))
    monkeypatch.setattr(cache_module, "content_digest", lambda p: hashed.append(p) or real(p))
    again = build_cache(copies, encoder, tmp_path / "cache", progress=False)
    assert (again.built, again.reused, hashed) == (0, 3, [])  # the aliases: found by stat
    assert all(again.cache.row(q) is not None for q in copies) and hashed == []


def test_rows_encoded_before_digests_were_kept_get_one(tmp_path, encoder, monkeypatch):
    """A shard index of the earlier layout (path, size, mtime) still serves; the next build records
    the digests of the files it matches, so a later touch is found by content too."""
    good = _good(tmp_path / "img", 2)
    first = build_cache(good, encoder, tmp_path / "cache", progress=False)
    index = next(first.cache.folder.glob("shard-*.json"))
    meta = json.loads(index.read_text())
    meta["images"] = [entry[:3] for entry in meta["images"]]  # no digests
    index.write_text(json.dumps(meta))
    counter = Counting(encoder, monkeypatch)
    assert build_cache(good, encoder, tmp_path / "cache", progress=False).reused == 2
    for p in good:
        os.utime(p, ns=(p.stat().st_atime_ns, p.stat().st_mtime_ns + 10**9))
    result = build_cache(good, encoder, tmp_path / "cache", progress=False)
    assert (result.built, result.reused, counter.n) == (0, 2, 0)


def test_one_file_under_two_spellings_is_encoded_once(tmp_path, encoder):
    good = _good(tmp_path / "img", 2)
    alias = tmp_path / "img" / ".." / "img" / good[0].name
    result = build_cache([good[0], alias, good[1]], encoder, tmp_path / "cache", progress=False)
    assert result.built == 2 and len(result.cache) == 2 and alias in result.cache


def test_new_encoder_key_gets_its_own_cache(tmp_path, encoder):
    good = _good(tmp_path / "img", 3)
    a = build_cache(good, encoder, tmp_path / "cache", progress=False)
    other = build_encoder(EncoderConfig(name="random", image_size=96))
    b = build_cache(good, other, tmp_path / "cache", progress=False)
    assert (b.built, b.reused) == (3, 0) and a.cache.folder != b.cache.folder
    assert b.cache.grid == (6, 6)


def test_added_images_go_into_new_shards_and_old_ones_are_never_rewritten(tmp_path, encoder):
    good = _good(tmp_path / "img", 5)
    first = build_cache(good[:3], encoder, tmp_path / "cache", progress=False).cache
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in first.folder.glob("shard-*")}
    result = build_cache(good, encoder, tmp_path / "cache", progress=False)
    assert (result.built, result.reused) == (2, 3) and len(result.cache) == 5 and result.cache.shards == 2
    assert all(p in result.cache for p in good)
    assert {name: (result.cache.folder / name).read_bytes() for name in before} == {n: b for n, (b, _) in before.items()}
    assert all((result.cache.folder / n).stat().st_mtime_ns == m for n, (_, m) in before.items())


def test_damaged_shards_are_ignored_and_their_images_encoded_again(tmp_path, encoder):
    good = _good(tmp_path / "img", 3)
    folder = build_cache(good, encoder, tmp_path / "cache", progress=False).cache.folder
    (shard,) = folder.glob("shard-*.json")
    shard.write_text("{broken")
    assert build_cache(good, encoder, tmp_path / "cache", progress=False).built == 3
    with open(folder / "shard-00001.f16", "r+b") as f:
        f.truncate(100)  # features do not match the index
    assert build_cache(good, encoder, tmp_path / "cache", progress=False).built == 3
    assert not list(folder.glob("*.tmp")) and not list(folder.glob(".*.tmp"))


KILLED_BUILD = """
import sys, time
import captioner.data.cache_build as cache_build
from captioner.config import EncoderConfig
from captioner.model.encoder import build_encoder

cache_build.SHARD_BYTES = 2 * 16 * 32 * 2  # two 4x4x32 float16 grids per shard
encoder = build_encoder(EncoderConfig(name="random", image_size=64))
infer = encoder.infer
encoder.infer = lambda images: (time.sleep(0.15), infer(images))[1]  # slow enough to be killed mid-build
cache_build.build_cache(sys.argv[2:], encoder, sys.argv[1], batch_size=1, progress=False)
"""


def test_a_sigkilled_build_keeps_its_finished_shards_and_the_next_one_reuses_them(tmp_path, encoder):
    good = [str(p) for p in _good(tmp_path / "img", 12)]
    cache_dir = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED_BUILD), str(cache_dir), *good],
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60

    def mid_shard() -> bool:  # two shards published, a third being written
        return len(list(cache_dir.glob("*/shard-*.json"))) >= 2 and bool(list(cache_dir.glob("*/.shard-*.tmp")))

    while not mid_shard() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    (folder,) = cache_dir.iterdir()
    finished = len(list(folder.glob("shard-*.json")))
    assert 2 <= finished < 6 and list(folder.glob(".*.tmp"))  # killed while writing the next shard

    result = build_cache(good, encoder, cache_dir, batch_size=1, progress=False)
    assert result.reused == 2 * finished and result.built == 12 - 2 * finished
    assert len(result.cache) == 12 and not list(folder.glob(".*.tmp"))
    with torch.inference_mode():  # the rows written before the kill are the right ones
        expected = encoder(encoder.transform()(load_image(good[0]))[None])[0].numpy()
    np.testing.assert_allclose(result.cache.get(good[0]).astype(np.float32), expected, rtol=1e-2, atol=1e-2)


def test_encoder_state_is_restored_and_cache_pickles_small(tmp_path, encoder):
    encoder.train()
    result = build_cache(_good(tmp_path / "img", 2), encoder, tmp_path / "cache", progress=False)
    assert encoder.training
    cache = result.cache
    cache.get_row(0)  # the shard is memory-mapped now
    blob = pickle.dumps(cache)
    assert len(blob) < 4000
    assert pickle.loads(blob).get(tmp_path / "img" / "img0.png").shape == (16, encoder.out_dim)


def test_all_images_broken_gives_an_empty_cache(tmp_path, encoder):
    (tmp_path / "img").mkdir()
    broken = _broken(tmp_path / "img")
    result = build_cache(list(broken), encoder, tmp_path / "cache", progress=False)
    assert result.built == 0 and len(result.skipped) == 4 and len(result.cache) == 0 and result.cache.nbytes == 0


def test_trainable_encoder_is_refused(tmp_path):
    enc = build_encoder(EncoderConfig(name="random", image_size=64, trainable_stages=1))
    with pytest.raises(ValueError, match="frozen"):
        build_cache([], enc, tmp_path, progress=False)
