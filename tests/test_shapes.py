"""The built-in shapes set: deterministic, 1-3 objects, captions true to the boxes."""
import re

import numpy as np
import pytest

from captioner.data.records import Box
from captioner.data.shapes import COLOURS, KINDS, describe, generate_shapes, make_example

OBJECT = re.compile(rf"\b({'|'.join(COLOURS)}) ({'|'.join(KINDS)})")


def _cx(b: Box) -> float:
    return (b.x0 + b.x1) / 2


def _check_caption(caption: str, boxes: list[Box]) -> None:
    """An independent reading of a caption against the geometry."""
    by_label = {b.label: b for b in boxes}
    named = [f"{c} {k}" for c, k in OBJECT.findall(caption)]
    assert sorted(named) == sorted(by_label), caption  # every object named exactly once, nothing else
    objs = [by_label[n] for n in named]
    if " to the left of " in caption:
        first, rest = objs[0], objs[1:]
        assert all(first.x1 < o.x0 if len(objs) == 2 else _cx(first) < _cx(o) for o in rest), caption
    elif " to the right of " in caption:
        first, rest = objs[0], objs[1:]
        assert all(first.x0 > o.x1 if len(objs) == 2 else _cx(first) > _cx(o) for o in rest), caption
    elif " above " in caption:
        assert objs[0].y1 < objs[1].y0, caption
    elif " below " in caption:
        assert objs[0].y0 > objs[1].y1, caption
    elif len(objs) == 3:  # a list: left to right
        assert _cx(objs[0]) < _cx(objs[1]) < _cx(objs[2]), caption


@pytest.mark.parametrize("size", [224, 128])
def test_examples_have_one_to_three_separate_large_objects_and_true_captions(size):
    counts = set()
    for i in range(150):
        image, boxes, captions = make_example(i, seed=0, size=size)
        assert image.size == (size, size) and image.mode == "RGB"
        assert 1 <= len(boxes) <= 3 and len(captions) == 5
        counts.add(len(boxes))
        kinds = [b.label.split()[1] for b in boxes]
        colours = [b.label.split()[0] for b in boxes]
        assert len(set(kinds)) == len(kinds) and len(set(colours)) == len(colours)
        for k, a in enumerate(boxes):
            assert 0 <= a.x0 < a.x1 <= size and 0 <= a.y0 < a.y1 <= size
            assert a.x1 - a.x0 >= 0.2 * size  # covers >1 cell of a 7x7 grid
            for b in boxes[k + 1:]:
                assert a.x1 <= b.x0 or b.x1 <= a.x0 or a.y1 <= b.y0 or b.y1 <= a.y0  # no overlap
            # the pixel inside the shape has the shape's colour (drawing matches the box)
            px = np.asarray(image)[int(a.y0 + 0.66 * (a.y1 - a.y0)), int(_cx(a))].astype(int)
            assert np.abs(px - np.array(COLOURS[a.label.split()[0]])).max() < 40
        for c in captions:
            _check_caption(c, boxes)
    assert counts == {1, 2, 3}


def test_generation_is_deterministic_for_a_seed():
    for i in range(10):
        im_a, boxes_a, caps_a = make_example(i, seed=5)
        im_b, boxes_b, caps_b = make_example(i, seed=5)
        assert boxes_a == boxes_b and caps_a == caps_b and im_a.tobytes() == im_b.tobytes()
    assert [make_example(i, 5)[1] for i in range(10)] != [make_example(i, 6)[1] for i in range(10)]


def test_describe_refuses_unclear_pairs():
    with pytest.raises(ValueError):
        describe([Box("red circle", 0, 0, 50, 50), Box("blue square", 40, 40, 90, 90)])


def test_written_once_reused_and_repaired(tmp_path):
    records = generate_shapes(tmp_path, n_images=30, seed=0, size=96)
    assert len(records) == 30 and [r.split for r in records[:10]].count("train") == 8
    assert records[0].boxes == tuple(make_example(0, 0, 96)[1])
    assert records[0].captions == tuple(make_example(0, 0, 96)[2])
    stamp = records[1].image.stat().st_mtime_ns
    assert generate_shapes(tmp_path, n_images=30, seed=0, size=96) == records
    assert records[1].image.stat().st_mtime_ns == stamp  # not rewritten
    records[2].image.unlink()
    assert generate_shapes(tmp_path, n_images=30, seed=0, size=96) == records and records[2].image.is_file()
    other = generate_shapes(tmp_path, n_images=30, seed=1, size=96)  # other settings -> regenerated
    assert [r.boxes for r in other] != [r.boxes for r in records]
