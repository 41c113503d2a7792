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
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

    Raises SourceError (one line, naming the file and, for JSON lines, the line; for a COCO file,
    the image or annotation id) on a missing or malformed file, or a bad entry: a box that is not
    four finite numbers, has no area or lies wholly outside its photo.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise SourceError(f"{path}: no such box file (JSON lines, or a COCO instances JSON)")
    text = _read_text(path)
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        return _read_jsonl(path, text.splitlines())
    if isinstance(whole, dict) and "annotations" in whole and "categories" in whole:
        return _read_coco(path)
    return _read_jsonl(path, text.splitlines())  # a file of one photo is JSON lines too


def _read_text(path: Path) -> str:
    """The text of a box file: one starting with "{" and UTF-8 throughout (a bad byte anywhere is an
    error naming its line)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SourceError(f"{path}: cannot read ({e})") from None
    if not data.lstrip().startswith(b"{"):
        raise SourceError(f"{path}: not a box file (expected JSON lines or a COCO instances JSON)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise SourceError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x}); expected JSON lines or "
                          f"a COCO instances JSON") from None


def _read_jsonl(path: Path, lines: Sequence[str]) -> dict[str, list[GroundObject]]:
    photos: dict[str, list[GroundObject]] = {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            entry = json.loads(line)
            name = Path(str(entry["image"])).name
            size = _size(entry, where)
            objects = [GroundObject(_names(o["words"]), tuple(_box(b, where, size) for b in o["boxes"]))
                       for o in entry["objects"]]
        except json.JSONDecodeError as e:
            raise SourceError(f"{where}: not JSON ({e.msg})") from None
        except (KeyError, TypeError) as e:
            raise SourceError(f"{where}: expected {{'image', 'objects': [{{'words', 'boxes'}}]}} ({e!r})") from None
        photos.setdefault(name, []).extend(o for o in objects if o.names and o.boxes)
    return photos


def _read_coco(path: Path) -> dict[str, list[GroundObject]]:
    coco = _load_coco(path)
    photos: dict[str, list[GroundObject]] = {}
    for img_id, info in coco.imgs.items():
        name, size = _coco_image(info, f"{path}: image id {img_id}")
        by_category: dict[int, list[BoxXYXY]] = {}
        for ann in coco.imgToAnns.get(img_id, []):
            where = f"{path}: annotation id {ann['id']}"
            category = _coco_category(coco.cats, ann, where)
            by_category.setdefault(category, []).append(_coco_box(ann, where, size))
        objects = [GroundObject(words_for_category(coco.cats[c]["name"]), tuple(boxes))
                   for c, boxes in by_category.items()]
        if objects:
            photos[name] = objects
    return photos


def _load_coco(path: Path) -> Any:
    """The file indexed by pycocotools (its `COCO` object)."""
    from pycocotools.coco import COCO

    try:
        return COCO(str(path))
    except Exception as e:  # pycocotools asserts on malformed files
        raise SourceError(f"{path}: not a COCO instances file ({type(e).__name__}: {e})") from None


def _coco_image(info: dict, where: str) -> tuple[str, tuple[float, float]]:
    """A COCO image entry's file name (no folder) and size."""
    if not isinstance(info.get("file_name"), str) or not info["file_name"].strip():
        raise SourceError(f"{where}: no 'file_name'")
    return Path(info["file_name"]).name, _size(info, where)


def _coco_category(cats: dict, ann: dict, where: str) -> int:
    """A COCO annotation's category id, checked to be a named entry of 'categories'."""
    category = ann["category_id"]
    if category not in cats or not isinstance(cats[category].get("name"), str):
        raise SourceError(f"{where}: category_id {category!r} is not a named entry of 'categories'")
    return category


def _coco_box(ann: dict, where: str, size: tuple[float, float]) -> BoxXYXY:
    """A COCO annotation's `bbox` [x, y, width, height] as (x0, y0, x1, y1), checked like a JSON-lines box."""
    if "bbox" not in ann:
        raise SourceError(f"{where}: no 'bbox'")
    x, y, w, h = _numbers(ann["bbox"], where, "[x, y, width, height]")
    return _in_photo((x, y, x + w, y + h), where, size)


def words_for_category(category: str) -> tuple[str, ...]:
    """The caption words that name a COCO category ("person" -> man, woman, boy, ...)."""
    return COCO_WORDS.get(category, (category.lower(),))


def objects_of(boxes: Iterable[Box]) -> list[GroundObject]:
    """The built-in records' boxes as objects: a box labelled "red circle" is named by each word of
    its label, "red" and "circle" (two boxes named alike are told apart by the caption's phrase)."""
    return [GroundObject(tuple(b.label.lower().split()), ((b.x0, b.y0, b.x1, b.y1),)) for b in boxes]


def _names(words: Iterable[object]) -> tuple[str, ...]:
    if isinstance(words, str):  # a bare string would be read letter by letter
        raise TypeError(f"'words' must be a list, got {words!r}")
    return tuple(dict.fromkeys(" ".join(str(w).lower().split()) for w in words if str(w).strip()))


def _box(b: object, where: str, size: tuple[float, float]) -> BoxXYXY:
    x0, y0, x1, y1 = _numbers(b, where, "[x0, y0, x1, y1]")
    if not (x0 < x1 and y0 < y1):
        raise SourceError(f"{where}: box {list(b)} has no area (x0 < x1 and y0 < y1 expected)")
    return _in_photo((x0, y0, x1, y1), where, size)


def _numbers(b: object, where: str, form: str) -> BoxXYXY:
    """Four finite numbers, else an error naming `where` and the expected `form`."""
    if not (isinstance(b, (list, tuple)) and len(b) == 4 and all(_finite(v) for v in b)):
        raise SourceError(f"{where}: a box must be {form} of finite numbers, got {b!r}")
    x0, y0, x1, y1 = (float(v) for v in b)
    return x0, y0, x1, y1


def _finite(v: object) -> bool:
    """A number (not a bool) that is neither infinite nor NaN (nor an integer too large for a float)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _size(entry: dict, where: str) -> tuple[float, float]:
    """A photo's (width, height) from its entry; infinite where not given (absent or null)."""
    width, height = (entry.get(k) for k in ("width", "height"))
    if not all(v is None or _finite(v) and v > 0 for v in (width, height)):
        raise SourceError(f"{where}: width and height must be positive numbers, got {width!r} x {height!r}")
    return (math.inf if width is None else float(width)), (math.inf if height is None else float(height))


def _in_photo(box: BoxXYXY, where: str, size: tuple[float, float]) -> BoxXYXY:
    """The box, unless it lies wholly outside a photo of `size` (width, height; pixels from 0)."""
    x0, y0, x1, y1 = box
    width, height = size
    if x1 <= 0 or y1 <= 0 or x0 >= width or y0 >= height:
        known = f" of {width:g} x {height:g} pixels" if math.isfinite(width + height) else ""
        raise SourceError(f"{where}: box {[x0, y0, x1, y1]} lies wholly outside the photo{known}")
    return box
