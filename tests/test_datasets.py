"""CaptionDataset / ImageDataset over the cache or images, the pure collate, and `prepare`."""
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from captioner.cli import main
from captioner.config import EncoderConfig
from captioner.data.cache_build import build_cache
from captioner.data.datasets import Batch, CaptionDataset, CaptionItem, ImageDataset, collate, collate_images
from captioner.data.records import Record
from captioner.data.vocab import build_vocabulary
from captioner.model.encoder import build_encoder


@pytest.fixture(scope="module")
def encoder():
    return build_encoder(EncoderConfig(name="random", image_size=64))


def _records(folder: Path, n: int = 4) -> list[Record]:
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for i in range(n):
        Image.new("RGB", (48, 32 + i), (50 * i, 100, 200)).save(folder / f"{i}.png")
        caps = tuple(f"a {'big ' * k}red circle number {i}" for k in range(5))
        records.append(Record(folder / f"{i}.png", caps, "val" if i == n - 1 else "train"))
    return records


def test_cached_dataset_shares_one_grid_per_image_and_drops_skipped_images(tmp_path, encoder):
    records = _records(tmp_path / "img")
    (tmp_path / "img" / "broken.png").write_text("not a png")
    records.append(Record(tmp_path / "img" / "broken.png", ("a caption",), "train"))
    cache = build_cache(records, encoder, tmp_path / "cache", progress=False).cache
    vocab = build_vocabulary(c for r in records for c in r.captions)
    ds = CaptionDataset(records, vocab, max_length=4, cache=cache)
    assert len(ds.records) == 4 and ds.dropped == [tmp_path / "img" / "broken.png"]
    assert len(ds) == 20
    items = [ds[i] for i in range(5)]  # the five captions of image 0
    assert all(it.image_id == 0 for it in items)
    assert items[0].inputs.shape == (16, encoder.out_dim) and items[0].inputs.dtype == torch.float32
    assert all(torch.equal(it.inputs, items[0].inputs) for it in items)
    assert items[0].tokens.tolist() == vocab.encode(records[0].captions[0], 4)
    assert max(len(it.tokens) for it in items) == 4 + 2  # cut at max_length words + <start>/<end>
    assert ds.references[0] == records[0].captions


def test_image_dataset_without_cache_returns_transformed_images(tmp_path, encoder):
    records = _records(tmp_path / "img", 3) + [Record(tmp_path / "gone.png", ("x",), "train")]
    vocab = build_vocabulary(c for r in records for c in r.captions)
    ds = CaptionDataset(records, vocab, cache=None, transform=encoder.transform(train=False))
    assert len(ds.dropped) == 1 and ds[0].inputs.shape == (3, 64, 64)
    images = ImageDataset(records, transform=encoder.transform())
    assert len(images) == 3
    batch = collate_images([images[0], images[2]])
    assert batch.inputs.shape == (2, 3, 64, 64) and batch.image_ids.tolist() == [0, 2]


def test_a_batch_reads_each_image_once_and_matches_item_by_item(tmp_path, encoder, monkeypatch):
    records = _records(tmp_path / "img", 3)
    vocab = build_vocabulary(c for r in records for c in r.captions)
    ds = CaptionDataset(records, vocab, cache=None, transform=encoder.transform(train=False))
    reads = []
    load = ds.load_input
    monkeypatch.setattr(ds, "load_input", lambda image_id: reads.append(image_id) or load(image_id))
    indices = [10, 0, 3, 11, 4, 5]  # images 2, 0, 0, 2, 0, 1
    items = ds.__getitems__(indices)
    assert sorted(reads) == [0, 1, 2]  # one JPEG decode per image, not one per caption
    for i, it in zip(indices, items):
        assert it.image_id == ds[i].image_id and torch.equal(it.tokens, ds[i].tokens)
        assert torch.equal(it.inputs, ds[i].inputs)
    loader = DataLoader(ds, batch_sampler=[indices], collate_fn=collate)  # the loader takes this path
    reads.clear()
    batch = next(iter(loader))
    assert sorted(reads) == [0, 1, 2] and batch.inputs.shape[0] == 3 and batch.rows.tolist() == [0, 1, 1, 0, 1, 2]


def test_collate_pads_and_counts_scored_positions():
    items = [CaptionItem(torch.ones(4, 3) * k, torch.tensor(ids), k)
             for k, ids in enumerate([[1, 5, 6, 2], [1, 7, 2], [1, 2]])]
    batch = collate(items, pad_id=0)
    assert isinstance(batch, Batch)
    assert batch.inputs.shape == (3, 4, 3)
    assert batch.tokens.tolist() == [[1, 5, 6, 2], [1, 7, 2, 0], [1, 2, 0, 0]]
    assert batch.lengths.tolist() == [3, 2, 1]  # words + <end>
    assert batch.image_ids.tolist() == [0, 1, 2]
    assert items[1].tokens.tolist() == [1, 7, 2]  # inputs untouched
    # the decoder's targets tokens[:, 1:] hold exactly `lengths` non-pad positions
    assert ((batch.tokens[:, 1:] != 0).sum(1) == batch.lengths).all()


def test_collate_stacks_each_image_once_for_all_its_captions():
    items = [CaptionItem(torch.ones(4, 3) * image, torch.tensor([1, 5, 2]), image) for image in [7, 3, 7, 7, 3, 9]]
    batch = collate(items)
    assert batch.image_ids.tolist() == [7, 3, 7, 7, 3, 9]
    assert batch.inputs.shape == (3, 4, 3)  # images 7, 3, 9
    assert batch.rows.tolist() == [0, 1, 0, 0, 1, 2]
    assert torch.equal(batch.inputs[batch.rows][:, 0, 0], batch.image_ids.float())  # every caption finds its image


def test_dataloader_with_a_worker_over_the_cache(tmp_path, encoder):
    records = _records(tmp_path / "img", 4)
    cache = build_cache(records, encoder, tmp_path / "cache", progress=False).cache
    vocab = build_vocabulary(c for r in records for c in r.captions)
    train = CaptionDataset([r for r in records if r.split == "train"], vocab, 20, cache=cache)
    assert len(train) == 15
    loader = DataLoader(train, batch_size=8, shuffle=True, num_workers=1, collate_fn=collate)
    batches = list(loader)
    assert sum(len(b.image_ids) for b in batches) == 15
    assert batches[0].inputs.shape[1:] == (16, encoder.out_dim)


def test_prepare_counts_the_vocabulary_fills_the_cache_and_train_encodes_nothing_again(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    _records(data / "Images", 10)
    rows = ["image,caption"] + [f'{i}.png,"A red circle, number {i}."' for i in range(10) for _ in range(5)]
    (data / "captions.txt").write_text("\n".join(rows))
    (data / "Images" / "3.png").write_bytes(b"")  # one broken image
    monkeypatch.setenv("CAPTIONER_CACHE", str(tmp_path / "home"))
    settings = ["model.encoder.name=random", "model.encoder.image_size=64", "data.val_fraction=0.2"]
    argv = ["prepare", "--data", str(data), "--device", "cpu", *settings]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "skipped:     1 images" in printed and "3.png: empty file" in printed
    assert "total        9 images        45 captions" in printed
    words = int(printed.split("vocabulary:")[1].split()[0])
    assert list((tmp_path / "home" / "features").glob("random-64-*/shard-00000.f16"))  # $CAPTIONER_CACHE/features
    assert main(argv) == 0 and "0 encoded now, 9 reused" in capsys.readouterr().out

    from captioner.data import cache_build

    encoded = []
    real = cache_build._encode
    monkeypatch.setattr(cache_build, "_encode", lambda *a, **k: encoded.append(len(a[5])) or real(*a, **k))
    argv = ["train", "--data", str(data), "--out", str(tmp_path / "run"), "--device", "cpu", *settings,
            "train.epochs=1", "train.amp=off", "model.decoder.feature_dim=8", "decode.max_length=4"]
    assert main(argv) == 0 and encoded == []  # the cache prepare filled, found by train
    trained = torch.load(tmp_path / "run" / "best.pt", weights_only=True)["vocab"]
    assert len(trained) == words and "circle" in trained  # as many words as prepare counted


def test_prepare_command_reports_bad_input_on_one_line(tmp_path, capsys):
    (tmp_path / "captions.txt").write_text("image,caption\na.jpg,one,two\n")
    assert main(["prepare", "--data", str(tmp_path), "model.encoder.name=random"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "captions.txt:2:" in err


def test_train_with_data_mirror_encodes_the_training_photos_flipped_once(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    _records(data / "Images", 8)
    rows = ["image,caption"] + [f'{i}.png,"A red circle on the left, number {i}."' for i in range(8) for _ in range(5)]
    (data / "captions.txt").write_text("\n".join(rows))
    monkeypatch.setenv("CAPTIONER_CACHE", str(tmp_path / "home"))
    settings = ["model.encoder.name=random", "model.encoder.image_size=64", "data.val_fraction=0.25"]
    assert main(["prepare", "--data", str(data), "--device", "cpu", *settings]) == 0  # the photos' own grids

    from captioner.data import cache_build

    encoded = []
    real = cache_build._encode
    monkeypatch.setattr(cache_build, "_encode", lambda *a, **k: encoded.append(len(a[5])) or real(*a, **k))
    argv = ["train", "--data", str(data), "--out", str(tmp_path / "run"), "--device", "cpu", *settings,
            "data.mirror=true", "train.epochs=1", "train.amp=off", "model.decoder.feature_dim=8",
            "decode.max_length=4"]
    assert main(argv) == 0 and encoded == [6]  # the 6 training photos mirrored, nothing else
    assert len(list((tmp_path / "home" / "features").iterdir())) == 2
    capsys.readouterr()
    assert main(["prepare", "--data", str(data), "--device", "cpu", *settings, "data.mirror=true"]) == 0
    assert encoded == [6] and "mirrored training photos:" in capsys.readouterr().out  # found, not encoded again
