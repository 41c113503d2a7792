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
])
def test_a_bad_line_is_named(tmp_path, line, message):
    path = tmp_path / "boxes.jsonl"
    path.write_text('{"image": "ok.jpg", "objects": []}\n' + line + "\n")
    with pytest.raises(SourceError, match=message):
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


def test_category_words_table():
    assert words_for_category("giraffe") == ("giraffe", "giraffes")
    assert words_for_category("hair drier") == ("hair drier",)  # not in the table: its own name
    assert all(names == tuple(dict.fromkeys(names)) and all(n == n.lower() for n in names)
               for names in COCO_WORDS.values())
