"""The attention-correctness protocol (Liu et al. 2017): the model teacher-forced on each photo's
*reference* captions, the map of the step that emits each word. Models are then compared on
identical words, whatever captions they would generate.

Shapes: N photos, B captions, T words, L = H'·W' regions.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from captioner.data.boxes import GroundObject
from captioner.data.images import ImageError, full_size, load_image
from captioner.data.records import Record
from captioner.data.vocab import tokenize
from captioner.decoding.captioner import Captioner
from captioner.decoding.forced import teacher_force
from captioner.decoding.grounding import GroundingSample


def reference_samples(captioner: Captioner, records: Sequence[Record],
                      objects: Callable[[Record], Sequence[GroundObject]], max_length: int = 20,
                      batch_size: int = 16) -> Iterator[GroundingSample]:
    """A GroundingSample per reference caption of each record with objects: the caption's words (cut at
    `max_length`) and the maps the model used to predict them. Unreadable images are skipped (the
    generated-caption evaluation reports them)."""
    chosen = [r for r in records if objects(r)]
    for start in range(0, len(chosen), batch_size):
        loaded = []
        for r in chosen[start : start + batch_size]:
            try:
                loaded.append((r, load_image(r.image, draft=captioner.image_side)))
            except ImageError:
                continue
        if loaded:
            yield from _forced_batch(captioner, loaded, objects, max_length)


def _forced_batch(captioner: Captioner, loaded: list, objects: Callable[[Record], Sequence[GroundObject]],
                  max_length: int) -> Iterator[GroundingSample]:
    vocab = captioner.vocab
    features = captioner.encode([image for _, image in loaded])  # (N, L, D)
    captions = [(i, tokenize(c)[:max_length]) for i, (r, _) in enumerate(loaded) for c in r.captions]
    captions = [(i, words) for i, words in captions if words]
    if not captions:
        return
    T = max(len(words) for _, words in captions)
    tokens = torch.zeros(len(captions), T + 2, dtype=torch.long)  # (B, T + 2) <pad> = 0
    for b, (_, words) in enumerate(captions):
        ids = vocab.encode(words)  # [<start>, w1..wn, <end>], unknown words as <unk>
        tokens[b, : len(ids)] = torch.tensor(ids)
    lengths = torch.tensor([len(words) + 1 for _, words in captions])  # (B,) words + <end>
    rows = torch.tensor([i for i, _ in captions])  # (B,)
    with torch.inference_mode():
        forced = teacher_force(captioner.model.decoder, features, tokens.to(features.device), lengths, rows)
    alphas = forced.alphas.cpu().numpy()  # (B, T + 1, L)
    H, W = captioner.grid
    for b, (i, words) in enumerate(captions):
        record, image = loaded[i]
        attention = alphas[b, : len(words)].reshape(len(words), H, W)  # (T, H', W'): the step emitting word t
        yield GroundingSample(words, attention, full_size(image), objects(record), captioner.model.encoder.cells)
