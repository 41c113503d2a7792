"""The built-in `shapes` data set: coloured circles, squares and triangles with true captions.

Each image holds one to three shapes of DIFFERENT kinds and DIFFERENT colours (so every shape
word and colour word names exactly one box, which is what attention grounding measures), that do
not overlap and are large enough to cover several cells of a 7x7 or 8x8 encoder grid. Captions
come from a few fixed templates (5 per image) whose relations are true to the geometry:

    1 shape    "a red circle", "there is a red circle", ...
    2 shapes   "a red circle to the left of a blue square", "a blue square below a red circle", ...
    3 shapes   "a red circle , a blue square and a green triangle" (left to right), ...

Everything is drawn from `random.Random` seeded per image, so a seed gives the same files on any
machine; the set is written once (PNGs + a Karpathy-style `dataset_shapes.json` whose images
carry an extra `boxes` field) and only regenerated when missing or made with other settings.
"""
from __future__ import annotations

import json
import logging
import os
import random
from pathlib import Path

from PIL import Image, ImageDraw

from captioner.data.readers import read_karpathy
from captioner.data.records import Box, Record
from captioner.files import cache_home

log = logging.getLogger(__name__)

VERSION = 1
JSON_NAME = "dataset_shapes.json"
KINDS: tuple[str, ...] = ("circle", "square", "triangle")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 80, 215),
    "yellow": (235, 195, 25),
    "purple": (140, 55, 185),
}


def default_root(n_images: int, seed: int, size: int = 224) -> Path:
    """`$CAPTIONER_CACHE/shapes-<seed>-<n>` (default cache `~/.cache/captioner`); `-<size>` added when not 224."""
    return cache_home() / (f"shapes-{seed}-{n_images}" + (f"-{size}" if size != 224 else ""))


def split_of(index: int) -> str:
    """Fixed 80/10/10 split by image index."""
    return {8: "val", 9: "test"}.get(index % 10, "train")


# --- geometry --------------------------------------------------------------------------------


def _centre(b: Box) -> tuple[float, float]:
    return (b.x0 + b.x1) / 2, (b.y0 + b.y1) / 2


def relation(a: Box, b: Box) -> str | None:
    """'left' (a left of b), 'right', 'above', 'below', or None when neither is clearly true.

    Clear means: the boxes are apart along that axis and the centre offset along it is at least
    1.5 times the offset along the other axis.
    """
    (ax, ay), (bx, by) = _centre(a), _centre(b)
    dx, dy = bx - ax, by - ay
    if abs(dx) >= 1.5 * abs(dy):
        if a.x1 < b.x0:
            return "left"
        if b.x1 < a.x0:
            return "right"
    if abs(dy) >= 1.5 * abs(dx):
        if a.y1 < b.y0:
            return "above"
        if b.y1 < a.y0:
            return "below"
    return None


def _apart(a: Box, b: Box, gap: int) -> bool:
    return a.x1 + gap <= b.x0 or b.x1 + gap <= a.x0 or a.y1 + gap <= b.y0 or b.y1 + gap <= a.y0


def _layout_ok(boxes: list[Box], size: int) -> bool:
    gap = max(2, round(0.04 * size))
    if any(not _apart(a, b, gap) for i, a in enumerate(boxes) for b in boxes[i + 1 :]):
        return False
    if len(boxes) == 2:
        return relation(boxes[0], boxes[1]) is not None
    if len(boxes) == 3:  # left-to-right order must be unmistakable
        xs = sorted(_centre(b)[0] for b in boxes)
        return min(xs[1] - xs[0], xs[2] - xs[1]) >= 0.2 * size
    return True


def sample_boxes(rng: random.Random, size: int = 224) -> list[Box]:
    """1-3 non-overlapping boxes of distinct kinds and colours, sides ~0.27-0.40 of `size`.

    Returned in left-to-right order of their centres.
    """
    n = rng.choice((1, 2, 3))
    kinds = rng.sample(KINDS, n)
    colours = rng.sample(list(COLOURS), n)
    lo, hi = round(0.27 * size), round(0.40 * size)
    margin = max(1, round(0.03 * size))
    for attempt in range(10_000):
        if attempt and attempt % 500 == 0:  # crowded: allow smaller shapes (rare)
            hi = max(lo, hi - 1)
            lo = max(round(0.2 * size), lo - 1)
        boxes = []
        for kind, colour in zip(kinds, colours):
            side = rng.randint(lo, hi)
            x0 = rng.randint(margin, size - margin - side)
            y0 = rng.randint(margin, size - margin - side)
            boxes.append(Box(f"{colour} {kind}", x0, y0, x0 + side, y0 + side))
        if _layout_ok(boxes, size):
            return sorted(boxes, key=lambda b: _centre(b)[0])
    raise RuntimeError(f"could not place {n} shapes in a {size} px image")  # pragma: no cover


# --- captions --------------------------------------------------------------------------------


def describe(boxes: list[Box]) -> list[str]:
    """Five true captions for shapes in left-to-right order (`sample_boxes` order)."""
    p = [f"a {b.label}" for b in boxes]
    if len(boxes) == 1:
        (a,) = p
        return [a, f"there is {a}", f"{a} in the picture", f"a single {boxes[0].label}", f"one {boxes[0].label}"]
    if len(boxes) == 2:
        rel = relation(boxes[0], boxes[1])
        if rel in ("left", "right"):  # p[0] is the left one
            first, second, fwd, back = p[0], p[1], "to the left of", "to the right of"
        elif rel == "above":
            first, second, fwd, back = p[0], p[1], "above", "below"
        elif rel == "below":
            first, second, fwd, back = p[1], p[0], "above", "below"
        else:
            raise ValueError(f"boxes {boxes} have no clear relation")
        return [
            f"{first} and {second}",
            f"{first} {fwd} {second}",
            f"{second} {back} {first}",
            f"there is {first} and {second}",
            f"{first} near {second}",
        ]
    if len(boxes) == 3:
        a, b, c = p
        return [
            f"{a} , {b} and {c}",
            f"there is {a} , {b} and {c}",
            f"{a} , {b} and {c} from left to right",
            f"{a} to the left of {b} and {c}",
            f"{c} to the right of {b} and {a}",
        ]
    raise ValueError(f"expected 1-3 boxes, got {len(boxes)}")


# --- drawing ---------------------------------------------------------------------------------


def _jitter(rng: random.Random, rgb: tuple[int, int, int], amount: int) -> tuple[int, int, int]:
    return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in rgb)  # type: ignore[return-value]


def draw(boxes: list[Box], rng: random.Random, size: int = 224) -> Image.Image:
    """An RGB `size`x`size` image: light background with a soft texture, shapes filling their boxes."""
    base = rng.randint(228, 248)
    background = _jitter(rng, (base, base, base), 6)
    im = Image.new("RGB", (size, size), background)
    # soft low-frequency texture: a coarse random grid upsampled (compresses well, looks less synthetic)
    coarse = Image.new("L", (8, 8))
    coarse.putdata([rng.randint(0, 255) for _ in range(64)])
    texture = coarse.resize((size, size), Image.BICUBIC)
    im = Image.blend(im, Image.merge("RGB", (texture, texture, texture)), 0.04)
    pen = ImageDraw.Draw(im)
    for b in boxes:
        colour, kind = b.label.split()
        fill = _jitter(rng, COLOURS[colour], 12)
        x0, y0, x1, y1 = int(b.x0), int(b.y0), int(b.x1), int(b.y1)
        if kind == "circle":
            pen.ellipse((x0, y0, x1, y1), fill=fill)
        elif kind == "square":
            pen.rectangle((x0, y0, x1, y1), fill=fill)
        else:  # triangle pointing up, base along the bottom of the box
            pen.polygon([(x0, y1), (x1, y1), ((x0 + x1) / 2, y0)], fill=fill)
    return im


def make_example(index: int, seed: int, size: int = 224) -> tuple[Image.Image, list[Box], list[str]]:
    """Image `index` of the set with `seed`: (image, boxes left to right, 5 captions). Pure."""
    rng = random.Random(seed * 1_000_003 + index)
    boxes = sample_boxes(rng, size)
    return draw(boxes, rng, size), boxes, describe(boxes)


# --- the set on disk -------------------------------------------------------------------------


def _is_complete(json_path: Path, n_images: int, seed: int, size: int) -> bool:
    try:
        data = json.loads(json_path.read_text())
    except (OSError, ValueError):
        return False
    meta = data.get("meta", {}) if isinstance(data, dict) else {}
    if meta != {"generator": "captioner.shapes", "version": VERSION, "seed": seed, "n_images": n_images, "size": size}:
        return False
    root = json_path.parent
    return all((root / im["filepath"] / im["filename"]).is_file() for im in data.get("images", []))


def generate_shapes(root: str | Path, n_images: int = 1000, seed: int = 0, size: int = 224) -> list[Record]:
    """Write (once) and read the shapes set under `root`; returns its records with boxes.

    Files: `root/images/00000.png ...` and `root/dataset_shapes.json`. Split 80/10/10 by image.
    """
    if n_images < 1:
        raise ValueError(f"n_images must be >= 1, got {n_images}")
    root = Path(root)
    json_path = root / JSON_NAME
    if not _is_complete(json_path, n_images, seed, size):
        log.info("generating %d shapes images (seed %d, %d px) in %s", n_images, seed, size, root)
        _write(root, n_images, seed, size)
    return read_karpathy(json_path, image_root=root)


def _write(root: Path, n_images: int, seed: int, size: int) -> None:
    (root / "images").mkdir(parents=True, exist_ok=True)
    entries = []
    for i in range(n_images):
        image, boxes, captions = make_example(i, seed, size)
        name = f"{i:05d}.png"
        tmp = root / "images" / f".{name}.{os.getpid()}.tmp"
        image.save(tmp, format="PNG")
        os.replace(tmp, root / "images" / name)  # concurrent writers produce identical files
        entries.append({
            "imgid": i,
            "filepath": "images",
            "filename": name,
            "split": split_of(i),
            "sentences": [{"raw": c, "tokens": c.replace(" ,", "").split()} for c in captions],
            "boxes": [{"label": b.label, "x0": b.x0, "y0": b.y0, "x1": b.x1, "y1": b.y1} for b in boxes],
        })
    meta = {"generator": "captioner.shapes", "version": VERSION, "seed": seed, "n_images": n_images, "size": size}
    tmp = root / f".{JSON_NAME}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"dataset": "shapes", "meta": meta, "images": entries}))
    os.replace(tmp, root / JSON_NAME)  # written last: its presence means the set is complete
