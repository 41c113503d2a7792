"""`captioner demo`: the whole tool on built-in data, offline, in a few CPU minutes.

Builds the shapes set, trains a small model from the shipped `shapes` config, scores it on the held-out
test split (caption metrics and attention grounding), captions one held-out image and draws where
the model looked for every word. Then the model bundled with the package (Flickr8k, no training)
captions real photos that come with the installation (matplotlib's sample photo; the Flickr8k dev
photos of `photos_dir` too, when given) and draws where it looked.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from pathlib import Path

from captioner.config import Config, load_config
from captioner.data.images import IMAGE_SUFFIXES, ImageError, is_image_file, load_image
from captioner.data.sources import load_records
from captioner.decoding.captioner import Caption, Captioner
from captioner.decoding.evaluation import Evaluation, evaluate_records
from captioner.errors import CaptionerError
from captioner.pictures.figures import plot_attention
from captioner.recipes.train import TrainResult, train

log = logging.getLogger(__name__)

CONFIG = "shapes"  # captioner/configs/shapes.yaml


@dataclass
class DemoResult:
    train: TrainResult
    evaluation: Evaluation  # on the shapes test split
    example: Caption  # the held-out image's caption
    picture: Path  # its attention picture
    photos: list[tuple[Caption, Path]]  # real photos captioned by the bundled model, with their pictures


def sample_photos(photos_dir: str | Path | None = None, n: int = 3) -> list[Path]:
    """Real photos at hand offline: matplotlib's sample photo, and the first `n` readable ones of
    `photos_dir` (a photo that cannot be read is reported and passed over). Raises CaptionerError
    when `photos_dir` is given but is not a folder of photos."""
    import matplotlib

    photos = [Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"]
    if photos_dir is not None:
        folder = Path(photos_dir)
        if not folder.is_dir():
            raise CaptionerError(f"{folder}: --photos needs a folder of photos; this is "
                                 f"{'a file' if folder.exists() else 'not there'}")
        found = sorted(p for p in folder.iterdir() if is_image_file(p))
        if not found:
            raise CaptionerError(f"{folder}: no photos in this folder ({' '.join(IMAGE_SUFFIXES)})")
        photos += itertools.islice((p for p in found if _readable(p)), n)
    return [p for p in photos if p.is_file()]


def _readable(path: Path) -> bool:
    """Whether `path` decodes as a photo; if not, say why (once) and move on."""
    try:
        load_image(path)
        return True
    except ImageError as e:
        log.warning("skipped: %s", e)
        return False


def caption_photos(photos: list[Path], out_dir: Path) -> list[tuple[Caption, Path]]:
    """Caption `photos` with the bundled model (none bundled: nothing) and draw each one's attention."""
    from captioner.deploy.folder import bundled_model
    from captioner.deploy.lite import lite_captioner

    folder = bundled_model()
    if folder is None or not photos:
        return []
    captioner = lite_captioner(folder)
    drawn = []
    for path, caption in zip(photos, captioner.caption([str(p) for p in photos])):
        drawn.append((caption, plot_attention(load_image(path), caption, out_dir / "photos" / f"{path.stem}.png")))
    return drawn


def demo_config(overrides: list[str] | None = None) -> Config:
    """The demo's config: the shipped shapes.yaml with overrides."""
    return load_config(CONFIG, overrides)


def run_demo(out_dir: str | Path, device: str = "auto", overrides: list[str] | None = None,
             photos_dir: str | Path | None = None) -> DemoResult:
    """Train on shapes into `out_dir`, evaluate on the test split, caption and draw one test image;
    then caption and draw real photos with the bundled model (`sample_photos(photos_dir)`)."""
    out_dir = Path(out_dir)
    cfg = demo_config(overrides)
    photos = sample_photos(photos_dir)  # before training: a wrong folder fails now, not in five minutes
    result = train(cfg, out_dir, device, overwrite=True)  # the demo's folder is the demo's: a rerun replaces it
    captioner = Captioner.from_checkpoint(result.best or result.last, device)
    test = [r for r in load_records(cfg.data) if r.split == "test"]
    evaluation = evaluate_records(captioner, test)
    # The held-out example: the first test image with the most objects, so the picture shows the
    # attention moving between them.
    record = max(test, key=lambda r: len(r.boxes))
    example = captioner.caption([record.image])[0]
    picture = plot_attention(load_image(record.image), example, out_dir / "attention.png")
    return DemoResult(result, evaluation, example, picture, caption_photos(photos, out_dir))
