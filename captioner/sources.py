"""Caption sources: read COCO, Karpathy, Flickr8k csv and Flickr8k token layouts into `Record`s.

`load_records(path)` detects the layout from a folder or a file. Sources with a split of their own
(COCO file names, Karpathy `split`, Flickr8k image lists) keep it; the others are split here BY
IMAGE with a fixed seed, so the captions of one image never straddle train and validation.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from captioner.errors import CaptionerError

log = logging.getLogger(__name__)

SPLITS: tuple[str, ...] = ("train", "val", "test")
LAYOUTS = (
    "'shapes' (built-in); a COCO captions JSON (captions_<split><year>.json) or a folder with "
    "annotations/captions_*.json; a Karpathy split JSON (dataset_*.json); a Flickr8k captions.txt "
    "(CSV 'image,caption', images in Images/) or its folder; a Flickr8k.token.txt (name.jpg#i<TAB>caption) "
    "or its folder"
)


class SourceError(CaptionerError):
    """A caption source that cannot be read: "FILE:LINE: reason", "FILE: key 'x': reason", ..."""


@dataclass(frozen=True)
class Box:
    """An object's box in pixels of the original image (x to the right, y down, x0 < x1, y0 < y1)."""

    label: str
    x0: float
    y0: float
    x1: float
    y1: float


@dataclass(frozen=True)
class Record:
    """One image, its captions, its split ("train" | "val" | "test") and optional object boxes."""

    image: Path
    captions: tuple[str, ...]
    split: str
    boxes: tuple[Box, ...] = ()

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"{self.image}: split {self.split!r} is not one of {', '.join(SPLITS)}")


# --- entry point -----------------------------------------------------------------------------


def load_records(
    path: str | Path,
    image_root: str | Path | None = None,
    val_fraction: float = 0.1,
    test_fraction: float = 0.0,
    split_seed: int = 0,
) -> list[Record]:
    """Records of the data set at `path` (a folder or a caption file, layout detected). The
    built-in `shapes` set is not a file: `captioner.prepare.load_data_records` handles it.

    `image_root` overrides where image files are looked for. `val_fraction`, `test_fraction`
    and `split_seed` are used only when the source has no split of its own.
    Raises SourceError (unknown layout, unparsable file, no images).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise SourceError(f"{path}: no such file or folder (accepted: {LAYOUTS})")
    _check_fractions(val_fraction, test_fraction)
    root = Path(image_root).expanduser() if image_root else None
    records: list[Record] = []
    has_split = True
    for file, reader in _detect(path):
        recs, split_given = reader(file, root)
        records += recs
        has_split &= split_given
    if not records:
        raise SourceError(f"{path}: no images with captions")
    if not has_split:
        records = assign_splits(records, val_fraction, test_fraction, split_seed)
    counts = {s: sum(r.split == s for r in records) for s in SPLITS}
    log.info("%s: %d images (%s)", path, len(records), ", ".join(f"{s} {n}" for s, n in counts.items()))
    return records


def split_records(records: Iterable[Record]) -> dict[str, list[Record]]:
    """Records grouped by split (every split present as a key, maybe empty)."""
    out: dict[str, list[Record]] = {s: [] for s in SPLITS}
    for r in records:
        out[r.split].append(r)
    return out


def _check_fractions(val_fraction: float, test_fraction: float) -> None:
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise SourceError(
            f"data.val_fraction={val_fraction}, data.test_fraction={test_fraction}: "
            "each must be in [0, 1) and their sum below 1"
        )


def assign_splits(records: list[Record], val_fraction: float, test_fraction: float = 0.0, seed: int = 0) -> list[Record]:
    """Split BY IMAGE with a fixed seed: round(n*fraction) images (at least 1 when the fraction > 0)
    go to val and test, the rest to train. Independent of the input order. Pure."""
    _check_fractions(val_fraction, test_fraction)
    n = len(records)
    order = sorted(range(n), key=lambda i: str(records[i].image))
    random.Random(seed).shuffle(order)
    n_val, n_test = (0 if f == 0 else max(1, round(n * f)) for f in (val_fraction, test_fraction))
    if n_val + n_test >= n:
        raise SourceError(f"{n} images are too few for val_fraction={val_fraction}, test_fraction={test_fraction}")
    split = [""] * n
    for rank, i in enumerate(order):
        split[i] = "val" if rank < n_val else "test" if rank < n_val + n_test else "train"
    return [replace(r, split=s) for r, s in zip(records, split)]


# --- layout detection ------------------------------------------------------------------------

Reader = Callable[[Path, "Path | None"], "tuple[list[Record], bool]"]


def _detect(path: Path) -> list[tuple[Path, Reader]]:
    """(file, reader) pairs for a folder or a file."""
    if path.is_dir():
        for name in ("captions.txt",):
            if (path / name).is_file():
                return [(path / name, _read_flickr_csv)]
        for rel in ("Flickr8k.token.txt", "Flickr8k_text/Flickr8k.token.txt", "results_20130124.token"):
            if (path / rel).is_file():
                return [(path / rel, _read_flickr_token)]
        karpathy = sorted(path.glob("dataset_*.json"))
        if len(karpathy) == 1:
            return [(karpathy[0], _read_json)]
        if len(karpathy) > 1:
            names = ", ".join(p.name for p in karpathy)
            raise SourceError(f"{path}: several Karpathy split files ({names}); pass one of them")
        coco = sorted(path.glob("annotations/captions_*.json")) or sorted(path.glob("captions_*.json"))
        if coco:
            return [(f, _read_json) for f in coco]
        raise SourceError(f"{path}: no caption file of a known layout in this folder (accepted: {LAYOUTS})")
    if path.suffix.lower() == ".json":
        return [(path, _read_json)]
    first = _first_line(path)
    if first.replace(" ", "").lower().startswith("image,caption"):
        return [(path, _read_flickr_csv)]
    if "\t" in first:
        return [(path, _read_flickr_token)]
    raise SourceError(f"{path}: unknown caption file layout (accepted: {LAYOUTS})")


def _first_line(path: Path) -> str:
    try:
        with path.open(encoding="utf-8-sig") as f:
            for line in f:
                if line.strip():
                    return line
    except UnicodeDecodeError:
        raise SourceError(f"{path}: not a UTF-8 text file (accepted: {LAYOUTS})") from None
    raise SourceError(f"{path}: empty caption file")


def _guess_root(file: Path, image_root: Path | None, candidates: list[Path], probe: str, sub: str = "") -> Path:
    """The first candidate folder holding `probe` (a relative image path). When `image_root` is
    given only it (and its subfolder `sub`, e.g. train2014) are candidates."""
    if image_root is not None:
        candidates = ([image_root / sub] if sub else []) + [image_root]
    for c in candidates:
        if (c / probe).is_file():
            return c
    fallback = candidates[-1] if image_root is not None else candidates[0]
    log.warning("%s: image %s not found under %s; pass image_root (--image-root)", file, probe, fallback)
    return fallback


def _group(pairs: Iterable[tuple[str, str]]) -> dict[str, list[str]]:
    """{image name: [captions]} in first-seen order; empty captions dropped."""
    out: dict[str, list[str]] = {}
    for name, caption in pairs:
        caps = out.setdefault(name, [])
        if caption.strip():
            caps.append(caption.strip())
    return out


# --- JSON: COCO and Karpathy -----------------------------------------------------------------


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        raise SourceError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise SourceError(f"{path}: not a UTF-8 text file") from None


def _read_json(path: Path, image_root: Path | None) -> tuple[list[Record], bool]:
    data = _load_json(path)
    if isinstance(data, dict) and isinstance(data.get("annotations"), list):
        return _read_coco(path, data, image_root), True
    images = data.get("images") if isinstance(data, dict) else None
    if isinstance(images, list) and (not images or isinstance(images[0], dict) and "sentences" in images[0]):
        return _read_karpathy(path, data, image_root), True
    raise SourceError(f"{path}: neither a COCO captions file (no 'annotations') nor a Karpathy split file "
                      f"(no 'images[].sentences')")


def _require(obj: Any, key: str, kind: type | tuple[type, ...], path: Path, where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise SourceError(f"{path}: key '{where}{key}': missing")
    value = obj[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise SourceError(f"{path}: key '{where}{key}': expected {names}, got {type(value).__name__}")
    return value


def _read_coco(path: Path, data: dict, image_root: Path | None) -> list[Record]:
    from pycocotools.coco import COCO  # imported lazily: only COCO sources need it

    images = _require(data, "images", list, path, "")
    for i, im in enumerate(images):
        _require(im, "id", int, path, f"images[{i}].")
        _require(im, "file_name", str, path, f"images[{i}].")
    ids = {im["id"] for im in images}
    for i, ann in enumerate(data["annotations"]):
        _require(ann, "caption", str, path, f"annotations[{i}].")
        if _require(ann, "image_id", int, path, f"annotations[{i}].") not in ids:
            raise SourceError(f"{path}: key 'annotations[{i}].image_id': no image with id {ann['image_id']}")
    coco = COCO()
    coco.dataset = data
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
        coco.createIndex()

    m = re.search(r"(train|val|test)\d*", path.stem)
    split = {"train": "train", "val": "val", "test": "test"}[m.group(1)] if m else "train"
    if not m:
        log.warning("%s: no train/val/test in the file name; treating it as train", path)
    folder = m.group(0) if m else ""
    base = path.parent.parent if path.parent.name == "annotations" else path.parent
    candidates = [base / folder, base / "images" / folder, base / "images", base] if folder else [base / "images", base]
    first = images[0]["file_name"] if images else ""
    root = _guess_root(path, image_root, candidates, first, folder)

    records = []
    for img_id in sorted(coco.getImgIds()):
        anns = sorted(coco.imgToAnns.get(img_id, []), key=lambda a: a.get("id", 0))
        captions = tuple(a["caption"].strip() for a in anns if a["caption"].strip())
        if captions:
            records.append(Record(root / coco.imgs[img_id]["file_name"], captions, split))
    if len(records) < len(images):
        log.info("%s: %d images without captions ignored", path, len(images) - len(records))
    return records


def read_karpathy(path: str | Path, image_root: str | Path | None = None) -> list[Record]:
    """Records of a Karpathy split JSON (`restval` counts as train; extra `boxes` are kept)."""
    path = Path(path)
    return _read_karpathy(path, _load_json(path), Path(image_root) if image_root else None)


def _read_karpathy(path: Path, data: dict, image_root: Path | None) -> list[Record]:
    images = _require(data, "images", list, path, "")
    split_names = {"train": "train", "restval": "train", "val": "val", "test": "test"}
    entries = []
    for i, im in enumerate(images):
        where = f"images[{i}]."
        filename = _require(im, "filename", str, path, where)
        filepath = im.get("filepath", "") or ""
        split = _require(im, "split", str, path, where)
        if split not in split_names:
            raise SourceError(f"{path}: key '{where}split': unknown split {split!r} (train, restval, val, test)")
        sentences = _require(im, "sentences", list, path, where)
        captions = []
        for j, s in enumerate(sentences):
            if isinstance(s, dict) and isinstance(s.get("raw"), str):
                captions.append(s["raw"].strip())
            elif isinstance(s, dict) and isinstance(s.get("tokens"), list):
                captions.append(" ".join(map(str, s["tokens"])))
            else:
                raise SourceError(f"{path}: key '{where}sentences[{j}].raw': missing")
        boxes = tuple(_box(b, path, f"{where}boxes[{k}].") for k, b in enumerate(im.get("boxes") or []))
        entries.append((f"{filepath}/{filename}" if filepath else filename, tuple(c for c in captions if c),
                        split_names[split], boxes))
    candidates = [path.parent / d for d in ("", "Images", "images", "Flicker8k_Dataset", "Flickr8k_Dataset",
                                             "flickr30k-images")] + [path.parent.parent]
    root = _guess_root(path, image_root, candidates, entries[0][0]) if entries else path.parent
    return [Record(root / rel, caps, split, boxes) for rel, caps, split, boxes in entries if caps]


def _box(b: Any, path: Path, where: str) -> Box:
    label = _require(b, "label", str, path, where)
    x0, y0, x1, y1 = (float(_require(b, k, (int, float), path, where)) for k in ("x0", "y0", "x1", "y1"))
    return Box(label, x0, y0, x1, y1)


# --- Flickr8k text layouts -------------------------------------------------------------------


def _read_flickr_csv(path: Path, image_root: Path | None) -> tuple[list[Record], bool]:
    """`captions.txt`: CSV with header `image,caption`, captions with commas quoted."""
    pairs = []
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            try:
                header = next(reader, None)
                if header is None:
                    raise SourceError(f"{path}: empty caption file")
                if [h.strip().lower() for h in header] != ["image", "caption"]:
                    raise SourceError(f"{path}:1: expected the header 'image,caption', got {','.join(header)!r}")
                for row in reader:
                    if not row or not "".join(row).strip():
                        continue
                    if len(row) != 2:
                        raise SourceError(f"{path}:{reader.line_num}: expected 2 fields (image,caption), got "
                                          f"{len(row)}; a caption containing a comma must be quoted")
                    if not row[0].strip():
                        raise SourceError(f"{path}:{reader.line_num}: empty image name")
                    pairs.append((row[0].strip(), row[1]))
            except csv.Error as e:
                raise SourceError(f"{path}:{reader.line_num}: not valid CSV ({e})") from None
    except UnicodeDecodeError:
        raise SourceError(f"{path}: not a UTF-8 text file") from None
    groups = _group(pairs)
    base = path.parent
    root = _guess_root(path, image_root, [base / "Images", base / "images", base], next(iter(groups), ""))
    return [Record(root / name, tuple(caps), "train") for name, caps in groups.items() if caps], False


def _read_flickr_token(path: Path, image_root: Path | None) -> tuple[list[Record], bool]:
    """`Flickr8k.token.txt`: `name.jpg#i<TAB>caption`; splits from `Flickr_8k.{train,dev,test}Images.txt`."""
    pairs = []
    try:
        with path.open(encoding="utf-8-sig") as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                if not line.strip():
                    continue
                if "\t" not in line:
                    raise SourceError(f"{path}:{lineno}: expected 'IMAGE#N<TAB>caption', found no tab")
                key, caption = line.split("\t", 1)
                name = key.rsplit("#", 1)[0].strip() if "#" in key else key.strip()
                if not name:
                    raise SourceError(f"{path}:{lineno}: empty image name")
                pairs.append((name, caption))
    except UnicodeDecodeError:
        raise SourceError(f"{path}: not a UTF-8 text file") from None
    groups = _group(pairs)
    folder, up = path.parent, path.parent.parent
    candidates = [d / n for d in (folder, up) for n in ("Flicker8k_Dataset", "Flickr8k_Dataset", "Images", "images",
                                                          "flickr30k-images")] + [folder]
    root = _guess_root(path, image_root, candidates, next(iter(groups), ""))

    lists = {split: folder / f"Flickr_8k.{name}Images.txt" for split, name in
             (("train", "train"), ("val", "dev"), ("test", "test"))}
    if not lists["train"].is_file():
        return [Record(root / n, tuple(c), "train") for n, c in groups.items() if c], False
    split_of: dict[str, str] = {}
    for split, list_path in lists.items():
        if list_path.is_file():
            for name in list_path.read_text(encoding="utf-8").split():
                split_of.setdefault(name, split)
    records = [Record(root / n, tuple(c), split_of[n]) for n, c in groups.items() if c and n in split_of]
    if len(records) < len(groups):
        log.info("%s: %d images in no split list ignored", path, len(groups) - len(records))
    return records, True
