"""Reading object boxes for the grounding score: JSON lines and COCO instances files."""
import json

import pytest

from captioner.data.boxes import COCO_WORDS, GroundObject, read_boxes, words_for_category
from captioner.data.records import SourceError


def test_reads_json_lines(tmp_path):
    path = tmp_path / "boxes.jsonl"
    rows = [{"image": "a.jpg", "width": 224, "height": 224,
             "objects": [{"words": ["dog", "Dogs"], "boxes": [[1, 2, 30, 40], [50, 50, 60, 70]]},
                         {"words": ["tennis ball"], "boxes": [[5, 5, 9, 9]]}]},
            {"image": "sub/b.jpg", "objects": []}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    photos = read_boxes(path)
    assert photos["a.jpg"] == [GroundObject(("dog", "dogs"), ((1, 2, 30, 40), (50, 50, 60, 70))),
                               GroundObject(("tennis ball",), ((5, 5, 9, 9),))]
    assert photos["b.jpg"] == []


@pytest.mark.parametrize("line, message", [
    ('{"image": "a.jpg", "objects": [{"words": ["dog"], "boxes": [[1, 2, 3]]}]}', r"boxes\.jsonl:2: a box must be"),
    ('{"image": "a.jpg", "objects": [{"words": ["dog"], "boxes": [[5, 2, 3, 9]]}]}', r"boxes\.jsonl:2: box .* no area"),
    ('{"image": "a.jpg"}', r"boxes\.jsonl:2: expected"),
    ('{"image": "a.jpg", ', r"boxes\.jsonl:2: not JSON"),
    ('{"image": "a.jpg", "objects": [{"words": ["dog"], "boxes": [[0, 0, Infinity, 9]]}]}',
     r"boxes\.jsonl:2: a box must be \[x0, y0, x1, y1\] of finite numbers"),
    ('{"image": "a.jpg", "objects": [{"words": ["dog"], "boxes": [[0, 0, NaN, 9]]}]}', r"boxes\.jsonl:2: .* finite"),
    ('{"image": "a.jpg", "objects": [{"words": ["dog"], "boxes": [[0, 0, 1e999, 9]]}]}', r"boxes\.jsonl:2: .* finite"),
    ('{"image": "a.jpg", "objects": [{"words": ["dog"], "boxes": [[-9, -9, -1, -1]]}]}',
     r"boxes\.jsonl:2: box .* lies wholly outside the photo"),
    ('{"image": "a.jpg", "width": 20, "height": 10, "objects": [{"words": ["dog"], "boxes": [[25, 0, 30, 5]]}]}',
     r"boxes\.jsonl:2: box .* lies wholly outside the photo of 20 x 10 pixels"),
    ('{"image": "a.jpg", "width": "wide", "objects": []}', r"boxes\.jsonl:2: width and height must be positive"),
    ('{"image": "a.jpg", "objects": [{"words": "dog", "boxes": [[1, 2, 3, 4]]}]}',
     r"boxes\.jsonl:2: expected .*'words' must be a list"),
])
def test_a_bad_line_is_named(tmp_path, line, message):
    path = tmp_path / "boxes.jsonl"
    path.write_text('{"image": "ok.jpg", "objects": []}\n' + line + "\n")
    with pytest.raises(SourceError, match=message):
        read_boxes(path)


def test_a_byte_not_utf8_anywhere_is_named_with_its_line(tmp_path):
    path = tmp_path / "boxes.jsonl"
    good = '{"image": "a.jpg", "objects": [{"words": ["dog"], "boxes": [[0, 0, 10, 10]]}]}\n'
    path.write_bytes(good.encode() * 400 + '{"image": "caf\u00e9.jpg", "objects": []}\n'.encode("latin-1"))
    with pytest.raises(SourceError, match=r"boxes\.jsonl:401: not UTF-8 text \(byte 0xe9\)"):
        read_boxes(path)


def test_missing_or_foreign_files(tmp_path):
    with pytest.raises(SourceError, match="no such box file"):
        read_boxes(tmp_path / "nope.jsonl")
    (tmp_path / "x.txt").write_text("hello\n")
    with pytest.raises(SourceError, match="not a box file"):
        read_boxes(tmp_path / "x.txt")


def test_reads_coco_instances_with_caption_words(tmp_path):
    coco = {"images": [{"id": 1, "file_name": "COCO_val2014_000000000001.jpg", "width": 640, "height": 480},
                       {"id": 2, "file_name": "2.jpg", "width": 10, "height": 10}],
            "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [10, 20, 100, 200], "area": 1, "iscrowd": 0},
                            {"id": 2, "image_id": 1, "category_id": 1, "bbox": [300, 20, 50, 50], "area": 1, "iscrowd": 0},
                            {"id": 3, "image_id": 1, "category_id": 18, "bbox": [0, 0, 5, 5], "area": 1, "iscrowd": 0}],
            "categories": [{"id": 1, "name": "person"}, {"id": 18, "name": "dog"}]}
    path = tmp_path / "instances_val2014.json"
    path.write_text(json.dumps(coco))
    photos = read_boxes(path)
    assert set(photos) == {"COCO_val2014_000000000001.jpg"}  # an image without boxes has no entry
    person, dog = photos["COCO_val2014_000000000001.jpg"]
    assert person.boxes == ((10, 20, 110, 220), (300, 20, 350, 70))  # x, y, w, h -> x0, y0, x1, y1
    assert {"man", "woman", "boy", "girl", "child", "people"} <= set(person.names)
    assert "puppy" in dog.names


def _coco_file(tmp_path, image=None, annotation=None):
    """A one-image, one-annotation COCO instances file, its entries updated (a None value drops the key)."""
    im = {"id": 1, "file_name": "a.jpg", "width": 100, "height": 50, **(image or {})}
    ann = {"id": 7, "image_id": 1, "category_id": 18, "bbox": [10, 10, 20, 20], **(annotation or {})}
    coco = {"images": [{k: v for k, v in im.items() if v is not None}],
            "annotations": [{k: v for k, v in ann.items() if v is not None}],
            "categories": [{"id": 18, "name": "dog"}]}
    path = tmp_path / "instances_val2014.json"
    path.write_text(json.dumps(coco))
    return path


@pytest.mark.parametrize("image, annotation, message", [
    ({}, {"bbox": None}, r"instances_val2014\.json: annotation id 7: no 'bbox'"),
    ({}, {"bbox": [0, 0, 5]}, r"instances_val2014\.json: annotation id 7: a box must be \[x, y, width, height\]"),
    ({}, {"bbox": [0, 0, float("inf"), 5]}, r"instances_val2014\.json: annotation id 7: .* finite numbers"),
    ({}, {"category_id": 3}, r"instances_val2014\.json: annotation id 7: category_id 3 is not a named entry"),
    ({"file_name": None}, {}, r"instances_val2014\.json: image id 1: no 'file_name'"),
    ({}, {"bbox": [0, 60, 10, 10]}, r"instances_val2014\.json: annotation id 7: box .* wholly outside .* 100 x 50"),
    ({}, {"bbox": [-1e9, -1e9, 1, 1]}, r"instances_val2014\.json: annotation id 7: box .* wholly outside"),
])
def test_a_bad_coco_entry_is_named(tmp_path, image, annotation, message):
    with pytest.raises(SourceError, match=message):
        read_boxes(_coco_file(tmp_path, image, annotation))


def test_coco_box_of_no_area_inside_the_photo_is_kept(tmp_path):
    """COCO's own files hold a few boxes 0 pixels high (train2017 ids 918, 2206849): not an error."""
    assert read_boxes(_coco_file(tmp_path, annotation={"bbox": [9.5, 18.5, 5.5, 0.0]}))["a.jpg"][0].boxes == (
        (9.5, 18.5, 15.0, 18.5),)


def test_category_words_table():
    assert words_for_category("giraffe") == ("giraffe", "giraffes")
    assert words_for_category("hair drier") == ("hair drier",)  # not in the table: its own name
    assert all(names == tuple(dict.fromkeys(names)) and all(n == n.lower() for n in names)
               for names in COCO_WORDS.values())
