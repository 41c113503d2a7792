"""The data entry point: `load_records(data_cfg)` -> the `Record`s of a data set.

`read_source(path)` detects the layout of a folder or a caption file (COCO, Karpathy, Flickr8k
csv, Flickr8k token) and reads it with `captioner.data.readers`; `path: shapes` is the built-in
set. Sources with a split of their own (COCO file names, Karpathy `split`, Flickr8k image lists)
keep it; the others are split here BY IMAGE with a fixed seed, so the captions of one image never
straddle train and validation.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from captioner.config import DataConfig
from captioner.data.readers import read_flickr_csv, read_flickr_token, read_json
from captioner.data.records import SPLITS, Record, SourceError, assign_splits
from captioner.data.shapes import default_root, generate_shapes

log = logging.getLogger(__name__)

LAYOUTS = (
    "'shapes' (built-in); a COCO captions JSON (captions_<split><year>.json) or a folder with "
    "annotations/captions_*.json; a Karpathy split JSON (dataset_*.json); a Flickr8k captions.txt "
    "(CSV 'image,caption', images in Images/) or its folder; a Flickr8k.token.txt (name.jpg#i<TAB>caption) "
    "or its folder"
)

Reader = Callable[[Path, "Path | None"], "tuple[list[Record], bool]"]


def load_records(cfg: DataConfig, image_root: str | Path | None = None,
                 shapes_root: str | Path | None = None) -> list[Record]:
    """The records of a data section: the source at `cfg.path` (split with its settings when it has
    no split of its own; images under `image_root`, else `cfg.image_root`, else where the caption
    file says), or, for `path: shapes`, the built-in set (generated once under `shapes_root`,
    default `$CAPTIONER_CACHE/shapes-<seed>-<n>`)."""
    if str(cfg.path) == "shapes":
        root = Path(shapes_root) if shapes_root else default_root(cfg.shapes_images, cfg.shapes_seed)
        return generate_shapes(root, cfg.shapes_images, cfg.shapes_seed)
    return read_source(cfg.path, image_root or cfg.image_root or None, cfg.val_fraction, cfg.test_fraction,
                       cfg.split_seed, cfg.val_fold)


def read_source(
    path: str | Path,
    image_root: str | Path | None = None,
    val_fraction: float = 0.1,
    test_fraction: float = 0.0,
    split_seed: int = 0,
    val_fold: int = 0,
) -> list[Record]:
    """Records of the data set at `path` (a folder or a caption file, layout detected).

    `image_root` overrides where image files are looked for. `val_fraction`, `test_fraction`,
    `split_seed` and `val_fold` are used only when the source has no split of its own.
    Raises SourceError (unknown layout, unparsable file, no images).
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise SourceError(f"{path}: no such file or folder (accepted: {LAYOUTS})")
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
        records = assign_splits(records, val_fraction, test_fraction, split_seed, val_fold)
    counts = {s: sum(r.split == s for r in records) for s in SPLITS}
    log.info("%s: %d images (%s)", path, len(records), ", ".join(f"{s} {n}" for s, n in counts.items()))
    return records


def _detect(path: Path) -> list[tuple[Path, Reader]]:
    """(file, reader) pairs for a folder or a file."""
    if path.is_dir():
        if (path / "captions.txt").is_file():
            return [(path / "captions.txt", read_flickr_csv)]
        for rel in ("Flickr8k.token.txt", "Flickr8k_text/Flickr8k.token.txt", "results_20130124.token"):
            if (path / rel).is_file():
                return [(path / rel, read_flickr_token)]
        karpathy = sorted(path.glob("dataset_*.json"))
        if len(karpathy) == 1:
            return [(karpathy[0], read_json)]
        if len(karpathy) > 1:
            names = ", ".join(p.name for p in karpathy)
            raise SourceError(f"{path}: several Karpathy split files ({names}); pass one of them")
        coco = sorted(path.glob("annotations/captions_*.json")) or sorted(path.glob("captions_*.json"))
        if coco:
            return [(f, read_json) for f in coco]
        raise SourceError(f"{path}: no caption file of a known layout in this folder (accepted: {LAYOUTS})")
    if path.suffix.lower() == ".json":
        return [(path, read_json)]
    first = _first_line(path)
    if first.replace(" ", "").lower().startswith("image,caption"):
        return [(path, read_flickr_csv)]
    if "\t" in first:
        return [(path, read_flickr_token)]
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
