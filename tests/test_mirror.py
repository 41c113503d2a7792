"""`data.mirror`: the mirrored photos' grids cached beside their own, read in either view with captions
whose "left" and "right" follow the view."""
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from torch.utils.data import DataLoader

from captioner.config import ConfigError, EncoderConfig, load_config
from captioner.data.cache_build import build_cache
from captioner.data.datasets import CaptionDataset, collate
from captioner.data.mirror import Mirrored, mirror_ids
from captioner.data.order import SeededItems
from captioner.data.records import Record
from captioner.data.vocab import build_vocabulary
from captioner.model.encoder import build_encoder


@pytest.fixture(scope="module")
def encoder():
    return build_encoder(EncoderConfig(name="random", image_size=64))


def _records(folder: Path, n: int = 3) -> list[Record]:
    """Photos red on the left, blue on the right (a mirror changes them), captions that say so."""
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        image = Image.new("RGB", (48, 40), (0, 0, 200))
        image.paste((200, 20 * i, 0), (0, 0, 16 + 4 * i, 40))
        image.save(folder / f"{i}.png")
        caps = (f"a red square on the left number {i}", "red to the left of blue", "a blue square on the right",
                "two colours", "red left blue right")
        records.append(Record(folder / f"{i}.png", caps, "train"))
    return records


def test_mirror_ids_swap_left_and_right_and_keep_every_other_word():
    vocab = build_vocabulary(["the dog on the left", "the cat on the right"])
    ids = mirror_ids(vocab)
    encoded = np.array(vocab.encode("the cat on the left the dog on the right"))
    assert vocab.decode(ids[encoded]) == "the cat on the right the dog on the left".split()
    changed = np.flatnonzero(ids != np.arange(len(vocab)))
    assert sorted(vocab.decode(changed)) == ["left", "right"]
    one_side = build_vocabulary(["the dog on the left"])  # no "right" to swap with: "left" stays
    assert np.array_equal(mirror_ids(one_side), np.arange(len(one_side)))


def test_mirrored_encoder_caches_the_flipped_photos_grids_in_a_folder_of_their_own(tmp_path, encoder):
    records = _records(tmp_path / "img")
    own = build_cache(records, encoder, tmp_path / "cache", progress=False).cache
    mirror = build_cache(records, Mirrored(encoder), tmp_path / "cache", progress=False)
    assert mirror.built == 3 and mirror.cache.folder != own.folder
    assert Mirrored(encoder).cache_key() != encoder.cache_key()
    image = Image.open(records[1].image).convert("RGB")
    with torch.inference_mode():
        flipped = encoder.infer(encoder.transform()(ImageOps.mirror(image))[None])[0]  # (L, D)
    stored = torch.from_numpy(np.asarray(mirror.cache.get(records[1].image), dtype=np.float32))
    assert torch.allclose(stored, flipped, atol=1e-2)  # stored as float16
    assert not torch.allclose(stored, torch.from_numpy(np.asarray(own.get(records[1].image), dtype=np.float32)),
                              atol=1e-2)
    again = build_cache(records, Mirrored(encoder), tmp_path / "cache", progress=False)
    assert (again.built, again.reused) == (0, 3)


def test_each_image_is_read_in_one_view_per_batch_with_its_captions_mirrored_alike(tmp_path, encoder):
    records = _records(tmp_path / "img")
    cache = build_cache(records, encoder, tmp_path / "cache", progress=False).cache
    mirror = build_cache(records, Mirrored(encoder), tmp_path / "cache", progress=False).cache
    vocab = build_vocabulary(c for r in records for c in r.captions)
    plain = CaptionDataset(records, vocab, cache=cache)
    ds = CaptionDataset(records, vocab, cache=cache, mirror=mirror)
    left, right = vocab.id("left"), vocab.id("right")
    views = []
    for seed in range(40):
        torch.manual_seed(seed)
        items = ds.__getitems__(list(range(len(ds))))  # every caption of the 3 images
        for image_id in range(3):
            mine = [(i, it) for i, it in enumerate(items) if it.image_id == image_id]
            mirrored = not torch.equal(mine[0][1].inputs, plain[mine[0][0]].inputs)
            want = mirror.get(records[image_id].image) if mirrored else cache.get(records[image_id].image)
            for i, it in mine:  # one view for all five captions, their side words as the view has them
                assert torch.equal(it.inputs, torch.from_numpy(np.asarray(want, dtype=np.float32)))
                expected = plain[i].tokens.clone()
                if mirrored:
                    expected[plain[i].tokens == left], expected[plain[i].tokens == right] = right, left
                assert torch.equal(it.tokens, expected)
            views.append(mirrored)
    assert 0.3 < np.mean(views) < 0.7  # even odds


def test_the_views_follow_the_seed_and_epoch_so_a_resumed_run_reads_the_same(tmp_path, encoder):
    records = _records(tmp_path / "img")
    cache = build_cache(records, encoder, tmp_path / "cache", progress=False).cache
    mirror = build_cache(records, Mirrored(encoder), tmp_path / "cache", progress=False).cache
    vocab = build_vocabulary(c for r in records for c in r.captions)
    batches = [[0, 5, 10], [1, 6, 11], [2, 7, 12], [3, 8, 13]]

    def epoch(seed: int, number: int) -> list[torch.Tensor]:
        items = SeededItems(CaptionDataset(records, vocab, cache=cache, mirror=mirror), seed)
        items.set_epoch(number)
        return [b.inputs for b in DataLoader(items, batch_sampler=batches, collate_fn=collate)]

    first = epoch(0, 0)
    assert all(torch.equal(a, b) for a, b in zip(first, epoch(0, 0)))
    others = epoch(0, 1) + epoch(1, 0)
    assert not all(torch.equal(a, b) for a, b in zip(first + first, others))


def test_mirror_needs_the_cache_of_a_frozen_encoder_cross_entropy_and_no_box_targets():
    assert load_config("shapes", ["data.mirror=true"]).data.mirror
    with pytest.raises(ConfigError, match="data.mirror"):
        load_config("shapes", ["data.mirror=true", "data.use_cache=false"])
    with pytest.raises(ConfigError, match="data.mirror"):
        load_config("shapes", ["data.mirror=true", "model.encoder.trainable_stages=1"])
    with pytest.raises(ConfigError, match="data.mirror.*cross-entropy only"):
        load_config("flickr8k-scst", ["data.mirror=true", "train.init=run/best.pt"])
    with pytest.raises(ConfigError, match="data.mirror.*box_weight"):
        load_config("shapes", ["data.mirror=true", "train.box_weight=1.0"])
