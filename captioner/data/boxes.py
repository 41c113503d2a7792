"""Object boxes for the grounding score: which caption words name which boxed things in a photo.

    read_boxes(path) -> {image file name: [GroundObject, ...]}

Two layouts are read:
- JSON lines, one photo a line: `{"image": "NAME.jpg", "width": W, "height": H, "objects":
  [{"words": ["dog", "dogs"], "boxes": [[x0, y0, x1, y1], ...]}]}` (pixels of the file as stored,
  x1/y1 exclusive, one box per visible instance);
- a COCO instances JSON (`instances_*.json`, read with pycocotools), each category named by the
  caption words of `COCO_WORDS` (person: man, woman, boy, ...).
The built-in shapes set carries its boxes on its records (`objects_of(record.boxes)`).
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from captioner.data.records import Box, SourceError

BoxXYXY = tuple[float, float, float, float]


@dataclass(frozen=True)
class GroundObject:
    """A thing in a photo: the caption words that name it and a box per visible instance.

    names: lowercase names; one may be a phrase ("tennis ball"), which a caption names by its last
        word preceded by the others.
    boxes: (x0, y0, x1, y1) in pixels of the photo as stored, x1/y1 exclusive.
    """

    names: tuple[str, ...]
    boxes: tuple[BoxXYXY, ...]


Boxes = dict[str, list[GroundObject]]  # photo file name -> its boxed objects (`read_boxes`)


# The caption words that name each COCO category (singular and plural); a category missing here
# is named by its own name.
COCO_WORDS: dict[str, tuple[str, ...]] = {
    "person": ("person", "people", "man", "men", "woman", "women", "boy", "boys", "girl", "girls", "child",
               "children", "kid", "kids", "guy", "guys", "lady", "ladies", "player", "players", "baby", "toddler",
               "skier", "surfer", "skateboarder", "snowboarder", "rider", "biker", "crowd"),
    "bicycle": ("bicycle", "bicycles", "bike", "bikes"),
    "motorcycle": ("motorcycle", "motorcycles", "motorbike", "motorbikes", "bike", "bikes"),
    "car": ("car", "cars", "vehicle", "truck"),
    "airplane": ("airplane", "airplanes", "plane", "planes", "jet", "aircraft"),
    "bus": ("bus", "buses"),
    "train": ("train", "trains"),
    "truck": ("truck", "trucks"),
    "boat": ("boat", "boats", "canoe", "kayak", "ship"),
    "traffic light": ("traffic light", "light", "lights"),
    "fire hydrant": ("hydrant", "fire hydrant"),
    "stop sign": ("stop sign", "sign"),
    "bench": ("bench", "benches"),
    "bird": ("bird", "birds", "seagull", "duck", "ducks"),
    "cat": ("cat", "cats", "kitten", "kitty"),
    "dog": ("dog", "dogs", "puppy", "puppies"),
    "horse": ("horse", "horses", "pony"),
    "sheep": ("sheep", "lamb"),
    "cow": ("cow", "cows", "cattle", "bull"),
    "elephant": ("elephant", "elephants"),
    "bear": ("bear", "bears"),
    "zebra": ("zebra", "zebras"),
    "giraffe": ("giraffe", "giraffes"),
    "backpack": ("backpack", "backpacks"),
    "umbrella": ("umbrella", "umbrellas"),
    "handbag": ("handbag", "bag", "purse"),
    "tie": ("tie", "ties"),
    "suitcase": ("suitcase", "suitcases", "luggage"),
    "frisbee": ("frisbee", "frisbees"),
    "skis": ("skis", "ski"),
    "snowboard": ("snowboard",),
    "sports ball": ("ball", "balls", "football", "soccer ball", "tennis ball", "basketball", "baseball"),
    "kite": ("kite", "kites"),
    "baseball bat": ("bat", "baseball bat"),
    "baseball glove": ("glove", "mitt"),
    "skateboard": ("skateboard", "skateboards"),
    "surfboard": ("surfboard", "surfboards", "board"),
    "tennis racket": ("racket", "racquet", "tennis racket"),
    "wine glass": ("glass", "glasses", "wine glass"),
    "cup": ("cup", "cups", "mug"),
    "couch": ("couch", "sofa"),
    "potted plant": ("plant", "plants"),
    "bed": ("bed", "beds"),
    "dining table": ("table", "tables"),
    "tv": ("tv", "television"),
    "laptop": ("laptop", "laptops", "computer"),
    "cell phone": ("phone", "cellphone", "cell phone"),
    "teddy bear": ("teddy bear", "teddy"),
}


def read_boxes(path: str | Path) -> Boxes:
    """The boxed objects of each photo, keyed by the photo's file name (no folder).

    Raises SourceError (one line, naming the file and, for JSON lines, the line) on a missing or
    malformed file.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise SourceError(f"{path}: no such box file (JSON lines, or a COCO instances JSON)")
    try:
        with path.open(encoding="utf-8") as f:
            head = f.read(1)
            while head.isspace():
                head = f.read(1)
    except (OSError, UnicodeDecodeError) as e:
        raise SourceError(f"{path}: cannot read ({e})") from None
    if head != "{":
        raise SourceError(f"{path}: not a box file (expected JSON lines or a COCO instances JSON)")
    text = path.read_text(encoding="utf-8")
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        return _read_jsonl(path, text.splitlines())
    if isinstance(whole, dict) and "annotations" in whole and "categories" in whole:
        return _read_coco(path)
    return _read_jsonl(path, text.splitlines())  # a file of one photo is JSON lines too


def _read_jsonl(path: Path, lines: Sequence[str]) -> dict[str, list[GroundObject]]:
    photos: dict[str, list[GroundObject]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
            name = Path(str(entry["image"])).name
            objects = [GroundObject(_names(o["words"]), tuple(_box(b, where) for b in o["boxes"]))
                       for o in entry["objects"]]
        except json.JSONDecodeError as e:
            raise SourceError(f"{where}: not JSON ({e.msg})") from None
        except (KeyError, TypeError) as e:
            raise SourceError(f"{where}: expected {{'image', 'objects': [{{'words', 'boxes'}}]}} ({e!r})") from None
        photos.setdefault(name, []).extend(o for o in objects if o.names and o.boxes)
    return photos


def _read_coco(path: Path) -> dict[str, list[GroundObject]]:
    from pycocotools.coco import COCO

    try:
        coco = COCO(str(path))
    except Exception as e:  # pycocotools asserts on malformed files
        raise SourceError(f"{path}: not a COCO instances file ({type(e).__name__}: {e})") from None
    photos: dict[str, list[GroundObject]] = {}
    for img_id, info in coco.imgs.items():
        by_category: dict[int, list[BoxXYXY]] = {}
        for ann in coco.imgToAnns.get(img_id, []):
            x, y, w, h = ann["bbox"]
            by_category.setdefault(ann["category_id"], []).append((x, y, x + w, y + h))
        objects = [GroundObject(words_for_category(coco.cats[c]["name"]), tuple(boxes))
                   for c, boxes in by_category.items()]
        if objects:
            photos[Path(info["file_name"]).name] = objects
    return photos


def words_for_category(category: str) -> tuple[str, ...]:
    """The caption words that name a COCO category ("person" -> man, woman, boy, ...)."""
    return COCO_WORDS.get(category, (category.lower(),))


def objects_of(boxes: Iterable[Box]) -> list[GroundObject]:
    """The built-in records' boxes as objects: a box labelled "red circle" is named by each word of
    its label, "red" and "circle" (two boxes named alike are told apart by the caption's phrase)."""
    return [GroundObject(tuple(b.label.lower().split()), ((b.x0, b.y0, b.x1, b.y1),)) for b in boxes]


def _names(words: Iterable[object]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(" ".join(str(w).lower().split()) for w in words if str(w).strip()))


def _box(b: object, where: str) -> BoxXYXY:
    if not (isinstance(b, (list, tuple)) and len(b) == 4 and all(isinstance(v, (int, float)) for v in b)):
        raise SourceError(f"{where}: a box must be [x0, y0, x1, y1], got {b!r}")
    x0, y0, x1, y1 = (float(v) for v in b)
    if not (x0 < x1 and y0 < y1):
        raise SourceError(f"{where}: box {list(b)} has no area (x0 < x1 and y0 < y1 expected)")
    return x0, y0, x1, y1
