"""Captioning an exported model with ONNX Runtime, numpy and Pillow alone: no torch, torchvision or timm.

    captioner = lite_captioner("flickr8k-onnx/")      # an export folder of `captioner export`
    (caption,) = captioner.caption(["photo.jpg"])     # .text, .attention (T, H', W'), .cells

`lite_captioner` is what `captioner caption` runs for an export folder (`--runtime onnx`, or the
model bundled with the package): a cold process captions a photo in well under the time torch takes
to import. It answers the part of the `Captioner` API that `caption`, `visualize` and the server use
(`caption`, `caption_files`, `preprocess`, `caption_pixels`, each with `text=`; `decode_config`,
`decode`, `vocab`, `grid`, `meta`, `model.encoder`), and its Captions equal those of
`deploy.runtime.onnx_captioner` (the torch beam search and teacher forcing over the same graphs): the
same pixels (`deploy.graphs.Preprocess`), the same search and forcing (`decoding.numpy_search`).
`evaluate` keeps `onnx_captioner`: its grounding of the reference captions needs the torch decoder.

Shapes: B images, L = H'·W' regions, T words.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from PIL import Image

from captioner.config import DecodeConfig
from captioner.config.parse import from_dict
from captioner.data.images import ImageError, full_size, load_image, prepare_image
from captioner.data.read_ahead import read_ahead
from captioner.data.vocab import Vocabulary
from captioner.decoding.caption import Caption
from captioner.decoding.numpy_search import Hypothesis, decode_n_best, force_text
from captioner.decoding.text import text_ids
from captioner.deploy import FormatError, require_onnx
from captioner.deploy.folder import cpu_threads, exported, read_manifest
from captioner.deploy.graphs import LiteModel, load_graphs

ImageInput = Image.Image | str | Path
_Settings = tuple[DecodeConfig, list[int] | None]  # a call's decode settings, the word ids of its text (or None)


class _Loaded(NamedTuple):
    pixels: np.ndarray  # (3, S, S), `LiteCaptioner.preprocess`
    size: tuple[int, int]  # (w, h) of the photo, upright
    path: str | None


class LiteCaptioner:
    """An exported model, its vocabulary and decode settings, ready to caption images on the CPU.

    Attributes:
        model: the graphs (`model.encoder`: name, image_size, grid, cells).
        vocab, decode, meta: the manifest's vocabulary, decode defaults (overridable per call) and
            training figures.
        grid: (H', W') of the encoder's output; image_side: its input side.
    """

    def __init__(self, model: LiteModel, vocab: Vocabulary, decode: DecodeConfig,
                 meta: dict[str, Any] | None = None) -> None:
        self.model, self.vocab, self.decode, self.meta = model, vocab, decode, meta or {}
        self.grid: tuple[int, int] = model.encoder.grid
        self.image_side: int = model.encoder.image_size

    def decode_config(self, **overrides: Any) -> DecodeConfig:
        """The default decode settings with `overrides` (DecodeConfig field names; None = keep), checked
        against the model (ConfigError: a setting it cannot honour)."""
        return self.decode.with_overrides(**overrides).usable_by(self.model.decoder.detects_words)

    def _settings(self, alternatives: int, text: str | None,
                  overrides: dict[str, Any]) -> tuple[DecodeConfig, list[int] | None]:
        """The call's decode settings and the word ids of its `text`, checked before any image is read."""
        cfg = self.decode_config(**overrides)
        if not 0 <= alternatives < (cfg.beam_size if text is None else 1):
            raise ValueError(f"alternatives {alternatives}: expected 0 to beam size - 1 ({cfg.beam_size - 1})"
                             if text is None else "alternatives: a caption given as text has none")
        return cfg, None if text is None else text_ids(text, self.vocab)

    def caption(self, images: Sequence[ImageInput], batch_size: int = 32, alternatives: int = 0,
                text: str | None = None, **decode_overrides: Any) -> list[Caption]:
        """Caption PIL images or image files, `batch_size` at a time, as `Captioner.caption` (`text`:
        these words forced on every image, with their `word_logprobs`): one Caption per image, in
        order; ImageError (one line, names the file) for an unreadable one."""
        settings = self._settings(alternatives, text, decode_overrides)
        out: list[Caption] = []
        batch: list[_Loaded] = []
        for _, loaded in read_ahead(self._read, images, 2 * batch_size):
            if isinstance(loaded, ImageError):
                raise loaded
            batch.append(loaded)
            if len(batch) == batch_size:
                out += self._caption_loaded(batch, settings, alternatives)
                batch = []
        return out + self._caption_loaded(batch, settings, alternatives)

    def caption_files(self, paths: Iterable[str | Path], batch_size: int = 32, text: str | None = None,
                      **decode_overrides: Any) -> Iterator[tuple[str, Caption | ImageError]]:
        """(path, Caption) or (path, ImageError) per file, lazily and in order, as `Captioner.caption_files`."""
        settings = self._settings(0, text, decode_overrides)
        files: list[tuple[str, _Loaded | ImageError]] = []
        loaded = 0
        for path, result in read_ahead(self._read, (str(p) for p in paths), 2 * batch_size):
            files.append((path, result))
            loaded += not isinstance(result, ImageError)
            if loaded == batch_size:
                yield from self._flush(files, settings)
                files, loaded = [], 0
        yield from self._flush(files, settings)

    def _flush(self, files: list[tuple[str, _Loaded | ImageError]],
               settings: _Settings) -> Iterator[tuple[str, Caption | ImageError]]:
        captions = iter(self._caption_loaded([r for _, r in files if not isinstance(r, ImageError)], settings, 0))
        for path, result in files:
            yield path, (result if isinstance(result, ImageError) else next(captions))

    def _read(self, image: ImageInput) -> _Loaded:
        """Decode (a JPEG at a reduced scale when the encoder's side allows) and preprocess one image."""
        if isinstance(image, Image.Image):
            rgb, path = prepare_image(image), None
        else:
            rgb, path = load_image(image, draft=self.image_side), str(image)
        return _Loaded(self.preprocess(rgb), full_size(rgb), path)

    def preprocess(self, image: Image.Image) -> np.ndarray:
        """An RGB image -> (3, S, S) float32, the encoder's eval preprocessing (the server runs it on
        its request threads)."""
        return self.model.encoder.transform(image)

    def caption_pixels(self, pixels: Sequence[np.ndarray], image_sizes: Sequence[tuple[int, int]],
                       paths: Sequence[str | None] | None = None, alternatives: int = 0, text: str | None = None,
                       **decode_overrides: Any) -> list[Caption]:
        """Caption images already preprocessed (`preprocess`), as one batch; `image_sizes` (w, h) of
        the originals and `paths` (default None) go into the Captions; `text` as in `caption`."""
        settings = self._settings(alternatives, text, decode_overrides)
        if not len(pixels):
            return []
        grid = self.model.encoder.infer(np.stack([np.asarray(p, dtype=np.float32) for p in pixels]))  # (B, L, D)
        return self._caption_grid(grid, image_sizes, paths or [None] * len(pixels), settings, alternatives)

    def _caption_loaded(self, items: list[_Loaded], settings: _Settings, alternatives: int) -> list[Caption]:
        if not items:
            return []
        grid = self.model.encoder.infer(np.stack([x.pixels for x in items]))  # (B, L, D_enc)
        return self._caption_grid(grid, [x.size for x in items], [x.path for x in items], settings, alternatives)

    def _caption_grid(self, grid: np.ndarray, image_sizes: Sequence[tuple[int, int]], paths: Sequence[str | None],
                      settings: _Settings, alternatives: int) -> list[Caption]:
        """The search over (B, L, D_enc) grids, or the given words forced on each, as Captions."""
        (cfg, ids), decoder = settings, self.model.decoder
        features, keys, initial = decoder.memory(grid)
        if ids is None:
            words = decoder.word_log_probs(grid) if cfg.detector_weight else None  # (B, V)
            ranked = decode_n_best(decoder.step, features, keys, initial, cfg, self.vocab, alternatives + 1, words)
        else:
            forced = force_text(decoder.step, features, keys, initial, ids, self.vocab, cfg.length_penalty)
            ranked = [[h] for h in forced]
        captions = []
        for hyps, size, path in zip(ranked, image_sizes, paths):
            best, *others = (self._to_caption(h, size, path) for h in hyps)
            captions.append(dataclasses.replace(best, alternatives=others))
        return captions

    def _to_caption(self, hyp: Hypothesis, image_size: tuple[int, int], path: str | None) -> Caption:
        words = [self.vocab.word(i) for i in hyp.tokens]
        attention = hyp.alphas.reshape(len(words), *self.grid)  # (T, H', W')
        attention = attention / attention.sum(axis=(1, 2), keepdims=True).clip(min=1e-12)
        return Caption(" ".join(words), words, hyp.score, hyp.logprob, attention.astype(np.float32),
                       (int(image_size[0]), int(image_size[1])), path, hyp.finished, self.model.encoder.cells,
                       word_logprobs=hyp.word_logprobs)


def lite_captioner(source: str | Path, decode: DecodeConfig | None = None, threads: int | None = None) -> LiteCaptioner:
    """A `LiteCaptioner` from an export folder (or a checkpoint, exported once into the cache, which
    needs torch that once). `threads`: the encoder's (default: OMP_NUM_THREADS, else every CPU)."""
    require_onnx(runtime_only=True)
    folder = exported(source)
    manifest = read_manifest(folder)
    try:
        vocab = Vocabulary.from_list(manifest["vocabulary"])
        decode = decode or from_dict(DecodeConfig, manifest["decode"], "decode")
        model = load_graphs(folder, manifest["encoder"], threads or cpu_threads())
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"{folder}: manifest.json lacks or mangles what the runtime needs ({type(e).__name__}: "
                          f"{e})") from None
    return LiteCaptioner(model, vocab, decode, manifest.get("meta", {}))
