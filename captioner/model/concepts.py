"""The decoder's word detector read as photo-level word probabilities (multiple-instance learning,
Fang et al. 2015): a photo shows word w when some region does,

    p(w) = 1 - prod over regions (1 - sigmoid(s_lw))   (noisy-OR)

    noisy_or(scores)             (N, L, K) region scores -> log p and log (1 - p), (N, K) each
    concept_slots(vocab, grouped) (V,) the detector output that stands for each word

Training fits p to the words of each photo's captions (`training.loss.concept_detection`); decoding
may add a content word's log p to its score (`decode.detector_weight`).
Shapes: N photos, L regions, K detector outputs, V vocabulary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from captioner.data.boxes import COCO_WORDS
from captioner.data.vocab import Vocabulary

INITIAL_DETECTOR_BIAS = -6.0  # a word is rare in a region: noisy-OR starts near 0


def noisy_or(scores: Tensor) -> tuple[Tensor, Tensor]:
    """(N, L, K) region scores -> (log p, log (1 - p)), (N, K) float32 each: a photo shows output k
    unless no region does."""
    log_absent = -F.softplus(scores.float()).sum(dim=1)  # (N, K) log prod (1 - sigmoid) = log(1 - p)
    log_present = torch.log(-torch.expm1(log_absent.clamp(max=-1e-6)))  # (N, K) log p
    return log_present, log_absent


def concept_slots(vocab: Vocabulary, grouped: bool) -> Tensor:
    """(V,) int64: the detector's output that stands for each word. Grouped, the words naming one
    kind of thing (a COCO category's words: man, woman, boy, girl... are all "person") share their
    first word's output, so the detector learns "a person is here" from every photo whose captions
    mention anyone, however they call them; else each word has its own."""
    slots = torch.arange(len(vocab))
    if grouped:
        for words in COCO_WORDS.values():
            ids = [vocab.id(w) for w in words if w in vocab and " " not in w]
            for i in ids:
                slots[i] = slots[ids[0]] if slots[i] == i else slots[i]  # a word in two groups keeps the first
    return slots
