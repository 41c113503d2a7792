"""Scoring a model on a split: caption the images, compare with the references (BLEU, METEOR,
ROUGE-L, CIDEr-D, object hallucination) and, where the data has object boxes, score the attention's
grounding.

    evaluate_records(captioner, records)   -> Evaluation    (any records, e.g. the demo's test split)
    evaluate_split(captioner, data, split) -> Evaluation    (`captioner.recipes.evaluate` loads a checkpoint for it)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from captioner.config import DataConfig, DecodeConfig
from captioner.data.boxes import Boxes, objects_of
from captioner.data.images import ImageError
from captioner.data.records import SPLITS, Record
from captioner.data.sources import load_records
from captioner.decoding.captioner import Caption, Captioner
from captioner.decoding.grounding import GroundingResult, GroundingSample, grounding_score
from captioner.decoding.hallucination import Hallucination, hallucinated_words, reference_hallucination
from captioner.decoding.metrics import attention_focus
from captioner.decoding.references import forced_samples, reference_captions
from captioner.decoding.scoring import score_captions
from captioner.errors import CaptionerError

Progress = Callable[[Iterator, int], Iterator]  # (iterator, total) -> the same items, e.g. through a tqdm


@dataclass
class Evaluation:
    """What an evaluation found.

    metrics: caption metrics (see `caption_metrics`); empty when no image could be captioned.
    grounding: attention grounding of the generated captions over the images that have boxes, else None.
    reference_grounding: the same, the model teacher-forced on the reference captions (the
        attention-correctness protocol: every model is scored on the same words), else None.
    relevance: with `relevance=True`, the same two scores of the gradient relevance maps
        (`relevance_maps`), under "generated" and "reference"; else empty.
    captions: the generated captions, in record order (unreadable images left out).
    references: image path -> its reference captions, for the captioned images.
    skipped: (path, reason) of the images that could not be read.
    decode: the decode settings used.
    diversity: share of captions ending on a function word, distinct words, distinct captions.
    focus: how sharply the words' maps peak (`attention_focus`).
    hallucination: CHAIR of the generated captions; reference_hallucination: of the references, each
        against the others of its photo (`captioner.decoding.hallucination`). None without captions.
    """

    metrics: dict[str, float]
    grounding: GroundingResult | None
    captions: list[Caption]
    references: dict[str, list[str]]
    skipped: list[tuple[str, str]]
    decode: DecodeConfig
    diversity: dict[str, float] = dataclasses.field(default_factory=dict)
    focus: dict[str, float] = dataclasses.field(default_factory=dict)
    reference_grounding: GroundingResult | None = None
    relevance: dict[str, GroundingResult] = dataclasses.field(default_factory=dict)
    hallucination: Hallucination | None = None
    reference_hallucination: Hallucination | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "images": len(self.captions),
            "skipped": [{"path": p, "reason": r} for p, r in self.skipped],
            "decode": dataclasses.asdict(self.decode),
            "metrics": self.metrics,
            "diversity": self.diversity,
            "focus": self.focus,
            "grounding": None if self.grounding is None else self.grounding.to_json(),
            "reference_grounding": None if self.reference_grounding is None else self.reference_grounding.to_json(),
            "relevance": {k: g.to_json() for k, g in self.relevance.items()} or None,
            "hallucination": None if self.hallucination is None else {
                "generated": self.hallucination.to_json(), "references": self.reference_hallucination.to_json()},
            "captions": [{**c.to_json(attention=False), "references": self.references[c.path],
                          "hallucinated": hallucinated_words(c.text, self.references[c.path])}
                         for c in self.captions],
        }


def evaluate_records(captioner: Captioner, records: Sequence[Record], batch_size: int = 32,
                     meteor: bool | None = None, progress: Progress | None = None, boxes: Boxes | None = None,
                     relevance: bool = False, **decode_overrides: Any) -> Evaluation:
    """Caption the records' images and score the captions against their references.

    Args:
        captioner: the model to evaluate.
        records: images with reference captions (and boxes, for grounding).
        batch_size: images per batch.
        meteor: see `caption_metrics` (None = when Java is available).
        progress: optional wrapper around the (path, result) iterator and its length, e.g. a tqdm.
        boxes: objects by photo file name, for grounding; None = the records' own boxes (shapes).
        relevance: also score the gradient relevance maps of the same words (torch decoder only).
        decode_overrides: DecodeConfig fields.
    Returns:
        An Evaluation; unreadable images are skipped and listed, not fatal.
    """
    by_path = {str(r.image): r for r in records}
    results = captioner.caption_files([str(r.image) for r in records], batch_size, **decode_overrides)
    captions, skipped = [], []
    for path, result in progress(results, len(records)) if progress else results:
        if isinstance(result, ImageError):
            skipped.append((path, str(result).removeprefix(f"{path}: ")))
        else:
            captions.append(result)
    references = {c.path: list(by_path[c.path].captions) for c in captions}
    scores = score_captions(references, {c.path: c.text for c in captions}, meteor)
    objects = _objects(boxes)
    grounded = [GroundingSample(c.tokens, c.attention, c.image_size, objects(by_path[c.path]), c.cells)
                for c in captions if objects(by_path[c.path])]
    grounding = grounding_score(grounded) if grounded else None
    cfg = captioner.decode_config(**decode_overrides)
    reference_words = reference_captions(cfg.max_length)
    forced = list(forced_samples(captioner, records, objects, reference_words)) if grounded else []
    relevant = {}
    if relevance and grounded:
        tokens = {c.path: c.tokens for c in captions}
        generated = lambda record: [tokens[str(record.image)]] if str(record.image) in tokens else []  # noqa: E731
        relevant = {"generated": grounding_score(forced_samples(captioner, records, objects, generated, "relevance")),
                    "reference": grounding_score(forced_samples(captioner, records, objects, reference_words, "relevance"))}
    return Evaluation(scores.metrics, grounding, captions, references, skipped, cfg, scores.diversity,
                      attention_focus([m for c in captions for m in c.attention]),
                      grounding_score(forced) if forced else None, relevant,
                      scores.hallucination if captions else None,
                      reference_hallucination(references) if captions else None)


def _objects(boxes: Boxes | None):
    """record -> its boxed objects: from `boxes` by file name, or the record's own boxes."""
    if boxes is None:
        return lambda record: objects_of(record.boxes)
    return lambda record: boxes.get(Path(record.image).name, [])


def evaluate_split(captioner: Captioner, data_cfg: DataConfig, split: str = "test", data: str | None = None,
                   image_root: str | Path | None = None, limit: int | None = None, batch_size: int = 32,
                   meteor: bool | None = None, progress: Progress | None = None, boxes: Boxes | None = None,
                   relevance: bool = False, **decode_overrides: Any) -> tuple[Evaluation, str]:
    """Score `captioner` on `split` of the data set `data_cfg` describes (or of `data`, read with those
    settings), for any runtime: `captioner.recipes.evaluate.evaluate_checkpoint` runs it on a checkpoint."""
    if split not in SPLITS:
        raise CaptionerError(f"split {split!r}: expected one of {', '.join(SPLITS)}")
    data_cfg = data_cfg if data is None else dataclasses.replace(data_cfg, path=str(data))
    records = load_records(data_cfg, image_root)
    chosen = [r for r in records if r.split == split][:limit]
    if not chosen:
        counts = ", ".join(f"{s} {sum(r.split == s for r in records)}" for s in SPLITS)
        raise CaptionerError(f"{data_cfg.path}: no images in split '{split}' ({counts}); choose another with --split")
    result = evaluate_records(captioner, chosen, batch_size, meteor, progress, boxes, relevance, **decode_overrides)
    return result, str(data_cfg.path)
