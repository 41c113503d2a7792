"""The Python API for captioning: `Captioner.from_checkpoint(path).caption(images) -> list[Caption]`.

    captioner = Captioner.from_checkpoint("runs/shapes/best.pt")
    (caption,) = captioner.caption(["photo.jpg"], beam_size=3)
    caption.text, caption.attention  # "a red circle", (T, H', W') maps summing to 1
    (forced,) = captioner.caption(["photo.jpg"], text="a blue circle")  # where it would look for these words
    forced.word_logprobs  # each given word's log-probability

`caption_files` streams a long list of files, yielding an ImageError for each unreadable one
instead of stopping. The CLI's `caption` and `visualize` are thin layers over this module;
`captioner.decoding.evaluation` scores a split with it.

Shapes: B batch, L = H'·W' regions, D feature width, T words.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import PIL.Image
import torch

from captioner.config import DecodeConfig
from captioner.data.images import ImageError, full_size, load_image, prepare_image
from captioner.data.read_ahead import read_ahead
from captioner.data.vocab import Vocabulary
from captioner.decoding.caption import Caption
from captioner.decoding.ensemble import EnsembleDecoder
from captioner.decoding.forced import force_text, text_ids
from captioner.decoding.search import Hypothesis, decode_n_best
from captioner.model.caption_model import CaptionModel
from captioner.model.checkpoint import Checkpoint, CheckpointError, load_checkpoint, restore_model
from captioner.model.encoder import CPU_CHUNK
from captioner.device import resolve_device

log = logging.getLogger(__name__)

ImageInput = PIL.Image.Image | str | Path
# Threads decoding and preprocessing images ahead of the model. On a CPU one keeps ahead (~3 ms an
# image against the model's 20+) and a second only competes with the model for the cores (one ONNX
# thread, 64 flickr8k-800 photos: 1.01-1.16x faster with one loader than with two, median 1.06x);
# a GPU model is fast enough to need several.
LOADER_THREADS = {"cpu": 1, "accelerator": 4}


class _Loaded(NamedTuple):
    pixels: torch.Tensor  # (3, S, S), `Captioner.preprocess`
    size: tuple[int, int]  # (w, h) of the photo, upright
    path: str | None
CheckpointSource = str | Path | Checkpoint


class _Batch:
    """Loaded images of one batch, encoded as they arrive: on a CPU every CPU_CHUNK images go through
    the encoder at once (the chunks `Encoder.infer` runs anyway), so the encoder works while the
    loader threads still read the rest of the batch; on a GPU the whole batch in one call."""

    def __init__(self, captioner: Captioner) -> None:
        self.captioner = captioner
        self.chunk = CPU_CHUNK if captioner.device.type == "cpu" else None
        self.items: list[_Loaded] = []
        self._grids: list[torch.Tensor] = []  # (c, L, D) per encoded chunk
        self._encoded = 0  # items already in _grids

    def __len__(self) -> int:
        return len(self.items)

    def add(self, loaded: _Loaded) -> None:
        self.items.append(loaded)
        if self.chunk is not None and len(self.items) - self._encoded >= self.chunk:
            self._encode()

    def _encode(self) -> None:
        pending = [x.pixels for x in self.items[self._encoded :]]
        if pending:
            self._grids.append(self.captioner._encode_pixels(pending))
            self._encoded = len(self.items)

    def features(self) -> torch.Tensor:
        """(B, L, D) grids of every image added, in order."""
        self._encode()
        return torch.cat(self._grids)


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
        self.image_side: int = model.encoder.image_size

    @classmethod
    def from_checkpoint(cls, path: CheckpointSource | Sequence[CheckpointSource], device: str | torch.device = "auto",
                        decode: DecodeConfig | None = None) -> Captioner:
        """Load a checkpoint (a path: CheckpointError on a bad file; or one already loaded), or several
        of one encoder and vocabulary, which then decode as an ensemble (`EnsembleDecoder`). `decode`
        defaults to the (first) checkpoint's own decode settings."""
        sources = list(path) if isinstance(path, (list, tuple)) else [path]
        ckpts = [s if isinstance(s, Checkpoint) else load_checkpoint(s) for s in sources]
        names = [str(s) if not isinstance(s, Checkpoint) else s.source or f"checkpoint {i + 1}"
                 for i, s in enumerate(sources)]
        models = [restore_model(c, n) for c, n in zip(ckpts, names)]
        for ckpt, name in zip(ckpts[1:], names[1:]):
            if ckpt.model_config.encoder != ckpts[0].model_config.encoder or ckpt.vocab != ckpts[0].vocab:
                raise CheckpointError(f"{name}: another encoder or vocabulary than {names[0]}: an ensemble needs "
                                      f"models of one encoder and one vocabulary")
        model = models[0] if len(models) == 1 else CaptionModel(
            models[0].encoder, EnsembleDecoder([m.decoder for m in models]))  # type: ignore[arg-type]
        return cls(model, ckpts[0].vocab, decode or ckpts[0].config.decode, device, ckpts[0].meta)

    def decode_config(self, **overrides: Any) -> DecodeConfig:
        """The default decode settings with `overrides` (DecodeConfig field names; None = keep), checked
        against the model (ConfigError: a setting it cannot honour)."""
        return self.decode.with_overrides(**overrides).usable_by(self.model.decoder.detects_words)

    # --- captioning ---------------------------------------------------------------------------

    def caption(self, images: Sequence[ImageInput], batch_size: int = 32, alternatives: int = 0,
                text: str | None = None, **decode_overrides: Any) -> list[Caption]:
        """Caption images, `batch_size` at a time (the encoder runs once per image).

        Args:
            images: PIL images or image file paths, treated alike (`prepare_image` / `load_image`: EXIF
                orientation applied, any mode to RGB).
            batch_size: images per encoder + search batch.
            alternatives: also keep this many next-best captions of the beam (less than beam_size).
            text: no search: these words on every image, teacher-forced; each Caption then holds them,
                the maps they were predicted with and their `word_logprobs`. TextError (one line) names
                the words the model does not know.
            decode_overrides: DecodeConfig fields, e.g. beam_size=3, max_length=16 (with `text` only
                length_penalty matters: the score).
        Returns:
            One Caption per image, in order. Raises ImageError (one line, names the file) for an
            unreadable file; `caption_files` skips those instead.
        """
        cfg, ids = self._settings(alternatives, text, decode_overrides)
        out: list[Caption] = []
        batch = _Batch(self)
        for _, loaded in self._read_ahead(images, 2 * batch_size):
            if isinstance(loaded, ImageError):
                raise loaded
            batch.add(loaded)
            if len(batch) == batch_size:
                out += self._caption_batch(batch, cfg, alternatives, ids)
                batch = _Batch(self)
        return out + self._caption_batch(batch, cfg, alternatives, ids)

    def caption_files(self, paths: Iterable[str | Path], batch_size: int = 32, text: str | None = None,
                      **decode_overrides: Any) -> Iterator[tuple[str, Caption | ImageError]]:
        """Caption image files lazily, in order: yields (path, Caption) or (path, ImageError) per file,
        so one unreadable file costs only itself. At most 3 x `batch_size` images are in memory."""
        cfg, ids = self._settings(0, text, decode_overrides)
        files: list[tuple[str, ImageError | None]] = []  # the batch's files in order, failed or not
        batch = _Batch(self)

        def flush() -> Iterator[tuple[str, Caption | ImageError]]:
            captions = iter(self._caption_batch(batch, cfg, 0, ids))
            for p, error in files:
                yield p, (error if error is not None else next(captions))

        for path, result in self._read_ahead((str(p) for p in paths), 2 * batch_size):
            files.append((path, result if isinstance(result, ImageError) else None))
            if not isinstance(result, ImageError):
                batch.add(result)
            if len(batch) == batch_size:
                yield from flush()
                files, batch = [], _Batch(self)
        if files:
            yield from flush()

    def _settings(self, alternatives: int, text: str | None,
                  overrides: dict[str, Any]) -> tuple[DecodeConfig, list[int] | None]:
        """The call's decode settings and the word ids of its `text`, checked before any image is read."""
        cfg = self.decode_config(**overrides)
        if text is not None and alternatives:
            raise ValueError("alternatives: a caption given as text has none (nothing is searched)")
        if not 0 <= alternatives < cfg.beam_size:
            raise ValueError(f"alternatives {alternatives}: expected 0 to beam size - 1 ({cfg.beam_size - 1})")
        return cfg, None if text is None else text_ids(text, self.vocab)

    def _read(self, image: ImageInput) -> _Loaded:
        """Decode (a JPEG at a reduced scale when the encoder's side allows) and preprocess one image."""
        if isinstance(image, PIL.Image.Image):
            rgb, path = prepare_image(image), None
        else:
            rgb, path = load_image(image, draft=self.image_side), str(image)
        return _Loaded(self.preprocess(rgb), full_size(rgb), path)

    def _read_ahead(self, images: Iterable[ImageInput], ahead: int) -> Iterator[tuple[ImageInput, _Loaded | ImageError]]:
        """`_read` of each image on the loader threads, at most `ahead` images in advance, in order."""
        return read_ahead(self._read, images, ahead, LOADER_THREADS["cpu" if self.device.type == "cpu" else "accelerator"])

    def preprocess(self, image: PIL.Image.Image) -> torch.Tensor:
        """An RGB image -> (3, S, S) normalised pixels on the CPU, the encoder's eval preprocessing
        (the server runs it on its request threads, off the model thread)."""
        return self.transform(image)

    @torch.inference_mode()
    def encode(self, images: Sequence[PIL.Image.Image]) -> torch.Tensor:
        """PIL images -> (B, L, D) encoder grids on `device` (the eval preprocessing, then the CNN)."""
        pixels = torch.stack([self.preprocess(im) for im in images]).to(self.device)  # (B, 3, S, S)
        return self.model.encoder.infer(pixels)  # (B, L, D); the search then takes the whole batch

    @torch.inference_mode()
    def caption_pixels(self, pixels: Sequence[torch.Tensor], image_sizes: Sequence[tuple[int, int]],
                       paths: Sequence[str | None] | None = None, alternatives: int = 0,
                       text: str | None = None, **decode_overrides: Any) -> list[Caption]:
        """Caption images already preprocessed (`preprocess`: (3, S, S) each), as one batch.
        `image_sizes` (w, h) of the originals go into the Captions, as do `paths` (default None);
        `text` as in `caption`."""
        cfg, ids = self._settings(alternatives, text, decode_overrides)
        if not pixels:
            return []
        return self._caption_features(self._encode_pixels(pixels), image_sizes, paths, cfg, alternatives, ids)

    @torch.inference_mode()
    def _encode_pixels(self, pixels: Sequence[torch.Tensor]) -> torch.Tensor:
        """(3, S, S) each -> (B, L, D) grids on `device`."""
        return self.model.encoder.infer(torch.stack(list(pixels)).to(self.device))

    @torch.inference_mode()
    def _caption_features(self, features: torch.Tensor, image_sizes: Sequence[tuple[int, int]],
                          paths: Sequence[str | None] | None, cfg: DecodeConfig, alternatives: int = 0,
                          ids: list[int] | None = None) -> list[Caption]:
        """The search over (B, L, D) grids, or the words `ids` forced on each, as Captions."""
        ranked = (decode_n_best(self.model.decoder, features, cfg, self.vocab, alternatives + 1) if ids is None
                  else [[h] for h in force_text(self.model.decoder, features, ids, self.vocab, cfg.length_penalty)])
        captions = []
        for hyps, size, p in zip(ranked, image_sizes, paths or [None] * len(features)):
            best, *others = (self._to_caption(h, size, p) for h in hyps)
            captions.append(dataclasses.replace(best, alternatives=others))
        return captions

    def _caption_batch(self, batch: _Batch, cfg: DecodeConfig, alternatives: int = 0,
                       ids: list[int] | None = None) -> list[Caption]:
        if not len(batch):
            return []
        return self._caption_features(batch.features(), [x.size for x in batch.items], [x.path for x in batch.items],
                                      cfg, alternatives, ids)

    def _to_caption(self, hyp: Hypothesis, image_size: tuple[int, int], path: str | None) -> Caption:
        words = [self.vocab.word(i) for i in hyp.tokens]
        attention = hyp.alphas.detach().float().cpu().numpy().reshape(len(words), *self.grid)  # (T, H', W')
        attention = attention / attention.sum(axis=(1, 2), keepdims=True).clip(min=1e-12)  # exact sums after bf16
        return Caption(" ".join(words), words, hyp.score, hyp.logprob, attention.astype(np.float32),
                       (int(image_size[0]), int(image_size[1])), path, hyp.finished,
                       self.model.encoder.cells, word_logprobs=hyp.word_logprobs)
