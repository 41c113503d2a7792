"""Captions decoded and scored: the one place both evaluation and training's validation do it.

    caption_batches(model, batches, cfg, vocab, device)  -> {image_id: caption}
    score_captions(references, captions, meteor)         -> Scores(metrics, diversity, hallucination)

Validation decodes this rank's share of the validation grids with `caption_batches`, gathers every
rank's captions and scores them with `score_captions`; `evaluate_records` scores a `Captioner`'s
captions of any records with the same function.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import NamedTuple

import torch

from captioner.config import DecodeConfig
from captioner.data.datasets import ImageBatch
from captioner.data.vocab import Vocabulary
from captioner.decoding.hallucination import Hallucination, hallucination
from captioner.decoding.metrics import caption_metrics, diversity
from captioner.decoding.search import decode
from captioner.model.caption_model import CaptionModel


class Scores(NamedTuple):
    metrics: dict[str, float]  # `caption_metrics` (BLEU-1..4, METEOR, ROUGE-L, CIDEr); {} without captions
    diversity: dict[str, float]  # `diversity`: dangling, distinct words, distinct captions
    hallucination: Hallucination  # CHAIR: object words no reference of the photo names


def score_captions(references: Mapping[Hashable, Sequence[str]], captions: Mapping[Hashable, str],
                   meteor: bool | None = None) -> Scores:
    """Score `captions` (key -> generated text) against the `references` of the same keys.

    Args:
        references: key -> its reference captions (raw text); may hold keys without a caption.
        captions: key -> the generated caption.
        meteor: see `caption_metrics` (None = when Java is available).
    """
    metrics = caption_metrics({k: references[k] for k in captions}, captions, meteor=meteor) if captions else {}
    return Scores(metrics, diversity(list(captions.values())), hallucination(references, captions))


@torch.no_grad()
def caption_batches(model: CaptionModel, batches: Iterable[ImageBatch], cfg: DecodeConfig, vocab: Vocabulary,
                    device: torch.device, *, cached: bool, amp_dtype: torch.dtype | None = None) -> dict[int, str]:
    """Caption every image of `batches` as `cfg` says, in eval mode (the model's mode is restored after).

    Args:
        model: the captioning model.
        batches: images by id, as cached grids (`cached`) or as pixels for `model.encode`.
        cfg, vocab: how to decode, and the words.
        device, amp_dtype: where, and under which autocast dtype (None: float32).
    Returns:
        image_id -> caption text.
    """
    was_training = model.training
    model.eval()
    captions: dict[int, str] = {}
    try:
        for batch in batches:
            inputs = batch.inputs.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
                features = inputs if cached else model.encode(inputs)  # (B, L, D)
                hyps = decode(model.decoder, features, cfg, vocab)
            for image_id, h in zip(batch.image_ids.tolist(), hyps):
                captions[image_id] = " ".join(vocab.decode(h.tokens))
    finally:
        model.train(was_training)
    return captions
