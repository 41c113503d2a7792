"""Maps for given captions, for grounding: the model teacher-forced on each photo's *reference*
captions (the attention-correctness protocol of Liu et al. 2017: models are then compared on
identical words, whatever captions they would generate), or on the captions it generated, with
either map, the attention the decoder used or the gradient relevance (`relevance_maps`).

Shapes: N photos, B captions, T words, L = H'·W' regions.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Literal

import torch

from captioner.data.boxes import GroundObject
from captioner.data.images import ImageError, full_size, load_image
from captioner.data.records import Record
from captioner.data.vocab import tokenize
from captioner.decoding.captioner import Captioner
from captioner.decoding.forced import teacher_force
from captioner.decoding.grounding import GroundingSample
from captioner.decoding.relevance import relevance_maps

MapKind = Literal["attention", "relevance"]
Captions = Callable[[Record], Sequence[Sequence[str]]]  # record -> the word lists to force on its photo


def reference_captions(max_length: int = 20) -> Captions:
    """A record's reference captions, tokenised and cut at `max_length` words."""
    return lambda record: [tokenize(c)[:max_length] for c in record.captions]


def forced_samples(captioner: Captioner, records: Sequence[Record],
                   objects: Callable[[Record], Sequence[GroundObject]], captions: Captions,
                   maps: MapKind = "attention", batch_size: int = 16) -> Iterator[GroundingSample]:
    """A GroundingSample per caption `captions` gives for each record with objects: its words and
    the maps of the steps that predicted them. Unreadable images are skipped (the generated-caption
    evaluation reports them)."""
    chosen = [r for r in records if objects(r)]
    for start in range(0, len(chosen), batch_size):
        loaded = []
        for r in chosen[start : start + batch_size]:
            try:
                loaded.append((r, load_image(r.image, draft=captioner.image_side)))
            except ImageError:
                continue
        if loaded:
            yield from _forced_batch(captioner, loaded, objects, captions, maps)


def _forced_batch(captioner: Captioner, loaded: list, objects: Callable[[Record], Sequence[GroundObject]],
                  captions: Captions, maps: MapKind) -> Iterator[GroundingSample]:
    vocab = captioner.vocab
    features = captioner.encode([image for _, image in loaded])  # (N, L, D)
    forced = [(i, list(words)) for i, (r, _) in enumerate(loaded) for words in captions(r) if words]
    if not forced:
        return
    T = max(len(words) for _, words in forced)
    tokens = torch.zeros(len(forced), T + 2, dtype=torch.long)  # (B, T + 2) <pad> = 0
    for b, (_, words) in enumerate(forced):
        ids = vocab.encode(words)  # [<start>, w1..wn, <end>], unknown words as <unk>
        tokens[b, : len(ids)] = torch.tensor(ids)
    lengths = torch.tensor([len(words) + 1 for _, words in forced])  # (B,) words + <end>
    rows = torch.tensor([i for i, _ in forced])  # (B,)
    decoder, tokens = captioner.model.decoder, tokens.to(features.device)
    if maps == "relevance":
        per_step = relevance_maps(decoder, features, tokens, lengths, rows)  # (B, T + 1, L)
    else:
        with torch.inference_mode():
            per_step = teacher_force(decoder, features, tokens, lengths, rows).alphas  # (B, T + 1, L)
    per_step = per_step.cpu().numpy()
    H, W = captioner.grid
    for b, (i, words) in enumerate(forced):
        record, image = loaded[i]
        word_maps = per_step[b, : len(words)].reshape(len(words), H, W)  # (T, H', W'): the step emitting word t
        yield GroundingSample(words, word_maps, full_size(image), objects(record), captioner.model.encoder.cells)
