"""The Python API for captioning: `Captioner.from_checkpoint(path).caption(images) -> list[Caption]`.

    captioner = Captioner.from_checkpoint("runs/shapes/best.pt")
    (caption,) = captioner.caption(["photo.jpg"], beam_size=3)
    caption.text, caption.attention  # "a red circle", (T, H', W') maps summing to 1

`caption_files` streams a long list of files, yielding an ImageError for each unreadable one
instead of stopping; `evaluate` captions records and scores them. The CLI's `caption`,
`visualize` and `evaluate` are thin layers over this module.

Shapes: B batch, L = H'·W' regions, D feature width, T words.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch

from captioner.checkpoint import load_model
from captioner.config import ConfigError, DecodeConfig, from_dict
from captioner.images import ImageError, load_image
from captioner.metrics import GroundingResult, GroundingSample, caption_metrics, grounding_score
from captioner.model import CaptionModel
from captioner.runtime import resolve_device
from captioner.search import Hypothesis, decode
from captioner.sources import Record
from captioner.vocab import Vocabulary

log = logging.getLogger(__name__)

ImageInput = PIL.Image.Image | str | Path
ENCODER_CPU_BATCH = 2  # images per encoder call on a CPU (see `Captioner.encode`)


@dataclass
class Caption:
    """A generated caption and where the model looked for each word.

    text: the words joined by spaces.
    tokens: the words (T of them).
    score: length-penalised log-probability (what beam search ranked by).
    logprob: summed log-probability of the words (and of <end> when finished).
    attention: (T, H', W') float32, each word's map over the encoder grid, summing to 1.
    image_size: (width, height) of the captioned image.
    path: the image file, when the image came from one.
    finished: False when the caption was cut at max_length without <end>.
    cell_offset: where the encoder's cells are centred, in cells from their nominal centres
        (`Encoder.cell_offset`); the pictures and the grounding score place the maps there.
    """

    text: str
    tokens: list[str]
    score: float
    logprob: float
    attention: np.ndarray
    image_size: tuple[int, int]
    path: str | None = None
    finished: bool = True
    cell_offset: float = 0.0

    def to_json(self, attention: bool = True) -> dict[str, Any]:
        """Plain JSON-ready dict; `attention` as nested lists, one (H', W') grid per word."""
        row: dict[str, Any] = {"path": self.path, "caption": self.text, "tokens": self.tokens,
                               "score": self.score, "logprob": self.logprob, "finished": self.finished}
        if attention:
            row["attention"] = self.attention.tolist()
            row["cell_offset"] = self.cell_offset
        return row


def decode_config_from_meta(meta: dict[str, Any]) -> DecodeConfig | None:
    """The decode settings a checkpoint's meta carries (`meta["decode"]` or `meta["config"]["decode"]`), if any."""
    for found in (meta.get("decode"), (meta.get("config") or {}).get("decode")):
        if isinstance(found, dict):
            try:
                return from_dict(DecodeConfig, found, "decode")
            except ConfigError as e:
                log.warning("ignoring the checkpoint's decode settings: %s", e)
    return None


class Captioner:
    """A model, its vocabulary and decode settings, ready to caption images.

    Attributes:
        model: the CaptionModel, in eval mode on `device`.
        vocab: its vocabulary.
        decode: the default DecodeConfig (overridable per call).
        device: where the model runs.
        transform: PIL image -> (3, S, S) normalised tensor, the encoder's eval preprocessing.
        grid: (H', W') of the encoder's output.
    """

    def __init__(self, model: CaptionModel, vocab: Vocabulary, decode: DecodeConfig | None = None,
                 device: str | torch.device = "cpu", meta: dict[str, Any] | None = None) -> None:
        self.device = resolve_device(device) if isinstance(device, str) else device
        self.model = model.to(self.device).eval()
        self.vocab = vocab
        self.decode = decode or DecodeConfig()
        self.meta = meta or {}
        self.transform = model.encoder.transform(train=False)
        self.grid: tuple[int, int] = tuple(model.encoder.grid)  # type: ignore[assignment]

    @classmethod
    def from_checkpoint(cls, path: str | Path, device: str | torch.device = "auto",
                        decode: DecodeConfig | None = None) -> Captioner:
        """Load a checkpoint (CheckpointError on a bad file). `decode` defaults to the checkpoint's
        own decode settings when it has them, else DecodeConfig()."""
        device = resolve_device(device) if isinstance(device, str) else device
        model, ckpt = load_model(path, device)
        return cls(model, ckpt.vocab, decode or decode_config_from_meta(ckpt.meta), device, ckpt.meta)

    def decode_config(self, **overrides: Any) -> DecodeConfig:
        """The default decode settings with `overrides` (DecodeConfig field names; None = keep)."""
        overrides = {k: v for k, v in overrides.items() if v is not None}
        names = {f.name for f in dataclasses.fields(DecodeConfig)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"unknown decode setting(s) {', '.join(unknown)} (known: {', '.join(sorted(names))})")
        return dataclasses.replace(self.decode, **overrides)

    # --- captioning ---------------------------------------------------------------------------

    def caption(self, images: Sequence[ImageInput], batch_size: int = 32, **decode_overrides: Any) -> list[Caption]:
        """Caption images, `batch_size` at a time (the encoder runs once per image).

        Args:
            images: PIL images or image file paths (loaded with `load_image`).
            batch_size: images per encoder + search batch.
            decode_overrides: DecodeConfig fields, e.g. beam_size=3, max_length=16.
        Returns:
            One Caption per image, in order. Raises ImageError (one line, names the file) for an
            unreadable file; `caption_files` skips those instead.
        """
        cfg = self.decode_config(**decode_overrides)
        out: list[Caption] = []
        for start in range(0, len(images), batch_size):
            chunk = images[start : start + batch_size]
            pil = [im if isinstance(im, PIL.Image.Image) else load_image(im) for im in chunk]
            paths = [None if isinstance(im, PIL.Image.Image) else str(im) for im in chunk]
            out += self._caption_batch(pil, paths, cfg)
        return out

    def caption_files(self, paths: Iterable[str | Path], batch_size: int = 32,
                      **decode_overrides: Any) -> Iterator[tuple[str, Caption | ImageError]]:
        """Caption image files lazily, in order: yields (path, Caption) or (path, ImageError) per file,
        so one unreadable file costs only itself. At most `batch_size` images are in memory."""
        cfg = self.decode_config(**decode_overrides)
        batch: list[tuple[str, PIL.Image.Image | ImageError]] = []  # files in order, loaded or failed

        def flush() -> Iterator[tuple[str, Caption | ImageError]]:
            good = [(p, im) for p, im in batch if not isinstance(im, ImageError)]
            captions = iter(self._caption_batch([im for _, im in good], [p for p, _ in good], cfg))
            for p, im in batch:
                yield p, (im if isinstance(im, ImageError) else next(captions))

        loaded = 0
        for path in paths:
            path = str(path)
            try:
                batch.append((path, load_image(path)))
                loaded += 1
            except ImageError as e:
                batch.append((path, e))
            if loaded == batch_size:
                yield from flush()
                batch, loaded = [], 0
        if batch:
            yield from flush()

    @torch.inference_mode()
    def encode(self, images: Sequence[PIL.Image.Image]) -> torch.Tensor:
        """PIL images -> (B, L, D) encoder grids on `device` (the eval preprocessing, then the CNN)."""
        pixels = torch.stack([self.transform(im) for im in images]).to(self.device)  # (B, 3, S, S)
        # On a CPU the CNN runs fastest on one or two images at a time (their activations stay in
        # cache; efficientnet_lite0 on 2 cores: ~1.5x faster per image than in chunks of 8, ~2x than
        # 32), while the search gains from the whole batch. On a GPU the whole batch goes at once.
        chunk = ENCODER_CPU_BATCH if self.device.type == "cpu" else len(images)
        return torch.cat([self.model.encode(pixels[i : i + chunk]) for i in range(0, len(images), chunk)])  # (B, L, D)

    @torch.inference_mode()
    def _caption_batch(self, images: list[PIL.Image.Image], paths: list[str | None],
                       cfg: DecodeConfig) -> list[Caption]:
        if not images:
            return []
        features = self.encode(images)  # (B, L, D)
        hyps = decode(self.model.decoder, features, cfg, self.vocab)
        return [self._to_caption(h, im.size, p) for h, im, p in zip(hyps, images, paths)]

    def _to_caption(self, hyp: Hypothesis, image_size: tuple[int, int], path: str | None) -> Caption:
        words = [self.vocab.word(i) for i in hyp.tokens]
        attention = hyp.alphas.detach().float().cpu().numpy().reshape(len(words), *self.grid)  # (T, H', W')
        attention = attention / attention.sum(axis=(1, 2), keepdims=True).clip(min=1e-12)  # exact sums after bf16
        return Caption(" ".join(words), words, hyp.score, hyp.logprob, attention.astype(np.float32),
                       (int(image_size[0]), int(image_size[1])), path, hyp.finished,
                       self.model.encoder.cell_offset)


# --- evaluation ------------------------------------------------------------------------------


@dataclass
class Evaluation:
    """What `evaluate` found.

    metrics: caption metrics (see `caption_metrics`); empty when no image could be captioned.
    grounding: attention grounding over the images that have boxes, else None.
    captions: the generated captions, in record order (unreadable images left out).
    references: image path -> its reference captions, for the captioned images.
    skipped: (path, reason) of the images that could not be read.
    decode: the decode settings used.
    """

    metrics: dict[str, float]
    grounding: GroundingResult | None
    captions: list[Caption]
    references: dict[str, list[str]]
    skipped: list[tuple[str, str]]
    decode: DecodeConfig

    def to_json(self) -> dict[str, Any]:
        return {
            "images": len(self.captions),
            "skipped": [{"path": p, "reason": r} for p, r in self.skipped],
            "decode": dataclasses.asdict(self.decode),
            "metrics": self.metrics,
            "grounding": None if self.grounding is None else dataclasses.asdict(self.grounding),
            "captions": [{**c.to_json(attention=False), "references": self.references[c.path]} for c in self.captions],
        }


def evaluate(captioner: Captioner, records: Sequence[Record], batch_size: int = 32, meteor: bool | None = None,
             progress: Callable[[Iterator], Iterator] | None = None, **decode_overrides: Any) -> Evaluation:
    """Caption the records' images and score the captions against their references.

    Args:
        captioner: the model to evaluate.
        records: images with reference captions (and boxes, for grounding).
        batch_size: images per batch.
        meteor: see `caption_metrics` (None = when Java is available).
        progress: optional wrapper around the (path, result) iterator, e.g. a tqdm.
        decode_overrides: DecodeConfig fields.
    Returns:
        An Evaluation; unreadable images are skipped and listed, not fatal.
    """
    by_path = {str(r.image): r for r in records}
    results = captioner.caption_files([str(r.image) for r in records], batch_size, **decode_overrides)
    captions, skipped = [], []
    for path, result in progress(results) if progress else results:
        if isinstance(result, ImageError):
            skipped.append((path, str(result).removeprefix(f"{path}: ")))
        else:
            captions.append(result)
    references = {c.path: list(by_path[c.path].captions) for c in captions}
    metrics = caption_metrics(references, {c.path: c.text for c in captions}, meteor=meteor) if captions else {}
    grounded = [GroundingSample(c.tokens, c.attention, c.image_size, by_path[c.path].boxes, c.cell_offset)
                for c in captions if by_path[c.path].boxes]
    grounding = grounding_score(grounded) if grounded else None
    return Evaluation(metrics, grounding, captions, references, skipped, captioner.decode_config(**decode_overrides))
