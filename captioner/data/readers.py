"""Readers of caption files, one per layout: COCO captions JSON, Karpathy split JSON, Flickr8k/30k
`captions.txt` (CSV) and `Flickr8k.token.txt`. Each takes (file, image_root) and returns
(records, whether the file gave the splits). `captioner.data.sources` picks the reader."""
from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from captioner.data.records import Box, Record, SourceError

log = logging.getLogger(__name__)


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


def _group(pairs: Iterable[tuple[str, str]], path: Path | None = None) -> dict[str, list[str]]:
    """{image name: [captions]} in first-seen order; captions with no words (empty, or only
    punctuation once tokenised) dropped, counted and reported once (naming `path`)."""
    from captioner.data.vocab import tokenize

    out: dict[str, list[str]] = {}
    empty = 0
    for name, caption in pairs:
        caps = out.setdefault(name, [])
        if tokenize(caption):
            caps.append(caption.strip())
        else:
            empty += 1
    if empty and path is not None:
        log.warning("%s: %d caption(s) with no words once tokenised skipped", path, empty)
    return out


# --- JSON: COCO and Karpathy -----------------------------------------------------------------


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as e:
        raise SourceError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except UnicodeDecodeError:
        raise SourceError(f"{path}: not a UTF-8 text file") from None


def read_json(path: Path, image_root: Path | None) -> tuple[list[Record], bool]:
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
        _require(ann, "id", int, path, f"annotations[{i}].")
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
        anns = sorted(coco.imgToAnns.get(img_id, []), key=lambda a: a["id"])
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
        boxes = tuple(_box(b, path, f"{where}boxes[{k}].") for k, b in enumerate(_boxes_of(im, path, where)))
        entries.append((f"{filepath}/{filename}" if filepath else filename, tuple(c for c in captions if c),
                        split_names[split], boxes))
    candidates = [path.parent / d for d in ("", "Images", "images", "Flicker8k_Dataset", "Flickr8k_Dataset",
                                             "flickr30k-images")] + [path.parent.parent]
    root = _guess_root(path, image_root, candidates, entries[0][0]) if entries else path.parent
    return [Record(root / rel, caps, split, boxes) for rel, caps, split, boxes in entries if caps]


def _boxes_of(im: dict, path: Path, where: str) -> list:
    """An image entry's optional `boxes` (absent or null: none), checked to be a list."""
    return _require(im, "boxes", list, path, where) if im.get("boxes") is not None else []


def _box(b: Any, path: Path, where: str) -> Box:
    """An image entry's box {label, x0, y0, x1, y1}: finite pixel coordinates with x0 < x1 and y0 < y1."""
    label = _require(b, "label", str, path, where)
    x0, y0, x1, y1 = (float(_require(b, k, (int, float), path, where)) for k in ("x0", "y0", "x1", "y1"))
    if not all(math.isfinite(v) for v in (x0, y0, x1, y1)) or not (x0 < x1 and y0 < y1):
        raise SourceError(f"{path}: key '{where.rstrip('.')}': box {[x0, y0, x1, y1]} is not finite with "
                          f"x0 < x1 and y0 < y1")
    return Box(label, x0, y0, x1, y1)


# --- Flickr8k text layouts -------------------------------------------------------------------


def read_flickr_csv(path: Path, image_root: Path | None) -> tuple[list[Record], bool]:
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


def read_flickr_token(path: Path, image_root: Path | None) -> tuple[list[Record], bool]:
    """`Flickr8k.token.txt`: `name.jpg#i<TAB>caption`; splits from `Flickr_8k.{train,dev,test}Images.txt`."""
    pairs, bad = [], []
    try:
        with path.open(encoding="utf-8-sig") as f:
            for lineno, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                if not line.strip():
                    continue
                key, tab, caption = line.partition("\t")
                name = key.rsplit("#", 1)[0].strip() if "#" in key else key.strip()
                if not tab or not name:  # one bad line costs itself, not the data set
                    bad.append(lineno)
                    continue
                pairs.append((name, caption))
    except UnicodeDecodeError:
        raise SourceError(f"{path}: not a UTF-8 text file") from None
    if not pairs:
        raise SourceError(f"{path}: no line of the form 'IMAGE#N<TAB>caption'" + (f" (line {bad[0]})" if bad else ""))
    if bad:
        log.warning("%s: %d line(s) not 'IMAGE#N<TAB>caption' skipped (first: line %d)", path, len(bad), bad[0])
    groups = _group(pairs, path)
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
            names = _split_list(list_path)
            uncaptioned = [n for n in names if not groups.get(n)]
            if uncaptioned:
                log.warning("%s: %d listed photo(s) have no captions in %s and are left out (first: %s)", list_path,
                            len(uncaptioned), path.name, uncaptioned[0])
            for name in names:
                split_of.setdefault(name, split)
    records = [Record(root / n, tuple(c), split_of[n]) for n, c in groups.items() if c and n in split_of]
    if len(records) < len(groups):
        log.info("%s: %d images in no split list ignored", path, len(groups) - len(records))
    return records, True


def _split_list(path: Path) -> list[str]:
    """The photo names of a `Flickr_8k.*Images.txt` split list."""
    try:
        return path.read_text(encoding="utf-8-sig").split()
    except UnicodeDecodeError:
        raise SourceError(f"{path}: not a UTF-8 text file") from None
