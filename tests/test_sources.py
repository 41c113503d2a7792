"""Caption sources: every layout, layout detection, the split by image, and one-line errors."""
import json
from pathlib import Path

import pytest
from PIL import Image

from captioner.config import DataConfig
from captioner.data.readers import read_karpathy
from captioner.data.records import Record, SourceError, assign_splits, split_records
from captioner.data.sources import load_records as load_data_records
from captioner.data.sources import read_source as load_records

REAL = Path(__file__).resolve().parents[1].parent / "shared/data/flickr8k-800"


def _images(folder: Path, names) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for n in names:
        Image.new("RGB", (8, 8)).save(folder / n)


def test_coco_folder_reads_every_captions_file_with_its_split(tmp_path):
    (tmp_path / "annotations").mkdir()
    for split, ids in (("train", [1, 2]), ("val", [3])):
        images = [{"id": i, "file_name": f"COCO_{split}2014_{i:012d}.jpg"} for i in ids]
        anns = [{"id": 10 * i + k, "image_id": i, "caption": f"caption {k} of {i}"} for i in ids for k in range(2)]
        (tmp_path / "annotations" / f"captions_{split}2014.json").write_text(
            json.dumps({"images": images, "annotations": anns}))
        _images(tmp_path / f"{split}2014", [im["file_name"] for im in images])
    records = load_records(tmp_path)
    assert [r.split for r in records] == ["train", "train", "val"]
    assert records[0].image == tmp_path / "train2014" / "COCO_train2014_000000000001.jpg"
    assert records[0].captions == ("caption 0 of 1", "caption 1 of 1")
    assert all(r.image.is_file() for r in records)
    assert len(load_records(tmp_path / "annotations" / "captions_val2014.json")) == 1


def test_karpathy_json_maps_restval_to_train_and_joins_filepath(tmp_path):
    data = {"images": [
        {"filepath": "val2014", "filename": "a.jpg", "split": "restval", "sentences": [{"raw": "A cat."}]},
        {"filepath": "val2014", "filename": "b.jpg", "split": "val", "sentences": [{"raw": "A dog."}]},
        {"filepath": "val2014", "filename": "c.jpg", "split": "test", "sentences": [{"tokens": ["a", "cow"]}]},
    ]}
    (tmp_path / "dataset_coco.json").write_text(json.dumps(data))
    _images(tmp_path / "val2014", ["a.jpg", "b.jpg", "c.jpg"])
    records = load_records(tmp_path)
    assert [r.split for r in records] == ["train", "val", "test"]
    assert records[0].image == tmp_path / "val2014" / "a.jpg"
    assert records[2].captions == ("a cow",)


def test_flickr_csv_with_quoted_commas_and_seeded_split_by_image(tmp_path):
    rows = ["image,caption"]
    for i in range(10):
        rows += [f'{i}.jpg,"A dog, running {k}."' for k in range(5)]
    (tmp_path / "captions.txt").write_text("\n".join(rows) + "\n")
    _images(tmp_path / "Images", [f"{i}.jpg" for i in range(10)])
    records = load_records(tmp_path, val_fraction=0.2, test_fraction=0.1, split_seed=3)
    assert len(records) == 10 and all(len(r.captions) == 5 for r in records)
    assert records[0].captions[0] == "A dog, running 0."
    assert records[0].image == tmp_path / "Images" / "0.jpg"
    assert [len(v) for v in split_records(records).values()] == [7, 2, 1]
    again = load_records(tmp_path / "captions.txt", val_fraction=0.2, test_fraction=0.1, split_seed=3)
    assert again == records  # same seed, same split; the file or its folder, same result
    other = load_records(tmp_path, val_fraction=0.2, test_fraction=0.1, split_seed=4)
    assert [r.split for r in other] != [r.split for r in records]


def test_flickr_token_with_split_lists(tmp_path):
    text = tmp_path / "Flickr8k_text"
    text.mkdir()
    lines = [f"{i}.jpg#{k}\tA caption {k} for {i} ." for i in range(4) for k in range(5)]
    (text / "Flickr8k.token.txt").write_text("\n".join(lines) + "\n")
    (text / "Flickr_8k.trainImages.txt").write_text("0.jpg\n1.jpg\n")
    (text / "Flickr_8k.devImages.txt").write_text("2.jpg\n")
    (text / "Flickr_8k.testImages.txt").write_text("3.jpg\n")
    _images(tmp_path / "Flicker8k_Dataset", [f"{i}.jpg" for i in range(4)])
    records = load_records(tmp_path)
    assert [r.split for r in records] == ["train", "train", "val", "test"]
    assert records[2].image == tmp_path / "Flicker8k_Dataset" / "2.jpg"
    assert len(records[0].captions) == 5


def test_flickr_token_without_lists_is_split_here(tmp_path):
    lines = [f"{i}.jpg#{k}\tcaption {k}" for i in range(20) for k in range(2)]
    (tmp_path / "Flickr8k.token.txt").write_text("\n".join(lines))
    records = load_records(tmp_path / "Flickr8k.token.txt", val_fraction=0.25)
    assert sum(r.split == "val" for r in records) == 5 and len(records) == 20


def test_split_is_by_image_and_independent_of_input_order():
    records = [Record(Path(f"{i}.jpg"), ("a", "b"), "train") for i in range(50)]
    a = assign_splits(records, 0.1, 0.1, seed=0)
    b = assign_splits(records[::-1], 0.1, 0.1, seed=0)
    assert {r.image: r.split for r in a} == {r.image: r.split for r in b}
    assert sum(r.split == "val" for r in a) == 5 and sum(r.split == "test" for r in a) == 5
    with pytest.raises(SourceError, match="too few"):
        assign_splits(records[:2], 0.5, 0.4)


def test_validation_folds_of_one_seed_are_disjoint_and_cover_every_image():
    records = [Record(Path(f"{i}.jpg"), ("a", "b"), "train") for i in range(40)]
    folds = [{r.image for r in assign_splits(records, 0.125, seed=3, val_fold=k) if r.split == "val"} for k in range(8)]
    assert all(len(f) == 5 for f in folds) and len(set().union(*folds)) == 40  # 8 disjoint folds of 5
    first = assign_splits(records, 0.125, seed=3)  # fold 0 is the split without folds
    assert {r.image for r in first if r.split == "val"} == folds[0]
    with pytest.raises(SourceError, match=r"data.val_fold 8: 40 images hold 8 folds of 5 validation images"):
        assign_splits(records, 0.125, seed=3, val_fold=8)


def test_bad_csv_names_file_and_line(tmp_path):
    path = tmp_path / "captions.txt"
    path.write_text("image,caption\na.jpg,A dog.\nb.jpg,A cat, unquoted, commas\n")
    with pytest.raises(SourceError, match=r"captions.txt:3: expected 2 fields"):
        load_records(path)
    path.write_text("name,text\na.jpg,A dog.\n")
    with pytest.raises(SourceError, match=r"captions.txt:1: expected the header"):
        load_records(tmp_path)


def test_bad_token_file_and_json_name_file_line_or_key(tmp_path):
    token = tmp_path / "Flickr8k.token.txt"
    token.write_text("b.jpg#0 no tab here\nc.jpg no tab either\n")
    with pytest.raises(SourceError, match=r"Flickr8k.token.txt: no line of the form .* \(line 1\)"):
        load_records(tmp_path)  # the folder: found by its file name, then read
    broken = tmp_path / "dataset_x.json"
    broken.write_text('{"images": [\n  {"filename": "a.jpg",\n }')
    with pytest.raises(SourceError, match=r"dataset_x.json:\d+: invalid JSON"):
        load_records(broken)
    broken.write_text(json.dumps({"images": [
        {"filename": "a.jpg", "split": "train", "sentences": [{"raw": "x"}]}, {"filename": "b.jpg", "sentences": []}]}))
    with pytest.raises(SourceError, match=r"dataset_x.json: key 'images\[1\].split': missing"):
        read_karpathy(broken)
    coco = tmp_path / "captions_train2017.json"
    coco.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.jpg"}],
                                "annotations": [{"id": 1, "image_id": 2, "caption": "x"}]}))
    with pytest.raises(SourceError, match=r"key 'annotations\[0\].image_id': no image with id 2"):
        load_records(coco)


@pytest.mark.parametrize("annotations, message", [
    ([{"image_id": 1, "caption": "a dog"}], r"captions_train2014\.json: key 'annotations\[0\]\.id': missing"),
    ([{"id": 1, "image_id": 1, "caption": "a dog"}, {"id": "z", "image_id": 1, "caption": "a cat"}],
     r"captions_train2014\.json: key 'annotations\[1\]\.id': expected int, got str"),
])
def test_coco_annotation_ids_are_checked(tmp_path, annotations, message):
    coco = tmp_path / "captions_train2014.json"
    coco.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.jpg"}], "annotations": annotations}))
    with pytest.raises(SourceError, match=message):
        load_records(coco)


def test_karpathy_boxes_must_be_a_list(tmp_path):
    path = tmp_path / "dataset_x.json"
    path.write_text(json.dumps({"images": [
        {"filename": "a.jpg", "split": "train", "sentences": [{"raw": "a dog"}], "boxes": None},
        {"filename": "b.jpg", "split": "train", "sentences": [{"raw": "a dog"}], "boxes": 5}]}))
    with pytest.raises(SourceError, match=r"dataset_x\.json: key 'images\[1\]\.boxes': expected list, got int"):
        load_records(path)


@pytest.mark.parametrize("box", [{"x0": 1, "y0": 2, "x1": 1, "y1": 9}, {"x0": 0, "y0": 0, "x1": 1e400, "y1": 5}])
def test_karpathy_boxes_must_have_finite_area(tmp_path, box):
    path = tmp_path / "dataset_x.json"
    path.write_text(json.dumps({"images": [{"filename": "a.jpg", "split": "train", "sentences": [{"raw": "a dog"}],
                                            "boxes": [{"label": "dog", **box}]}]}))
    with pytest.raises(SourceError, match=r"dataset_x\.json: key 'images\[0\]\.boxes\[0\]': box .* is not finite"):
        load_records(path)


def test_flickr_split_list_not_utf8_is_named(tmp_path):
    (tmp_path / "Flickr8k.token.txt").write_text("a.jpg#0\tA dog runs.\n")
    (tmp_path / "Flickr_8k.trainImages.txt").write_bytes("a.jpg\ncaf\u00e9.jpg\n".encode("latin-1"))
    with pytest.raises(SourceError, match=r"Flickr_8k\.trainImages\.txt: not a UTF-8 text file"):
        load_records(tmp_path)


def test_unknown_layout_missing_path_and_empty_set(tmp_path):
    (tmp_path / "notes.md").write_text("hello\n")
    with pytest.raises(SourceError, match="accepted"):
        load_records(tmp_path)
    with pytest.raises(SourceError, match="unknown caption file layout"):
        load_records(tmp_path / "notes.md")
    with pytest.raises(SourceError, match="no such file"):
        load_records(tmp_path / "nope")
    (tmp_path / "captions.txt").write_text("image,caption\n")
    with pytest.raises(SourceError, match="no images with captions"):
        load_records(tmp_path)


def test_shapes_source_is_generated_under_the_given_root(tmp_path):
    cfg = DataConfig(path="shapes", shapes_images=20, shapes_seed=1)
    records = load_data_records(cfg, shapes_root=tmp_path / "s")
    assert len(records) == 20 and all(r.image.is_file() and r.boxes for r in records)
    assert {r.split for r in records} == {"train", "val", "test"}


def test_shapes_default_root_follows_captioner_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPTIONER_CACHE", str(tmp_path))
    records = load_data_records(DataConfig(path="shapes", shapes_images=10, shapes_seed=2))
    assert records[0].image.parent.parent == tmp_path / "shapes-2-10"


@pytest.mark.skipif(not REAL.is_dir(), reason="shared flickr8k-800 data not present")
def test_real_flickr8k_800_loads():
    records = load_records(REAL)
    assert len(records) == 800 and sum(len(r.captions) for r in records) == 4000
    assert all(r.image.is_file() for r in records[:50])
    assert {r.split for r in records} == {"train", "val"}


def test_flickr_token_mistakes_are_skipped_counted_and_reported_once(tmp_path, caplog):
    """The real data set's mistakes: a line without a tab, a caption with no words once tokenised, a
    split list naming photos with no captions. Each costs only itself and is reported once, by count."""
    import logging

    (tmp_path / "Flickr8k.token.txt").write_text(
        "a.jpg#0\tA dog runs.\nb.jpg#0 no tab here\nc.jpg#0 no tab either\na.jpg#1\t ... !\nd.jpg#0\tA cat.\n")
    (tmp_path / "Flickr_8k.trainImages.txt").write_text("a.jpg\nghost.jpg\nphantom.jpg\n")
    (tmp_path / "Flickr_8k.devImages.txt").write_text("d.jpg\n")
    with caplog.at_level(logging.WARNING):
        records = load_records(tmp_path)
    by_name = {r.image.name: r for r in records}
    assert set(by_name) == {"a.jpg", "d.jpg"} and by_name["a.jpg"].captions == ("A dog runs.",)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for said in ("2 line(s) not 'IMAGE#N<TAB>caption' skipped (first: line 2)",
                 "1 caption(s) with no words once tokenised skipped", "2 listed photo(s) have no captions"):
        assert sum(said in w for w in warnings) == 1, (said, warnings)
