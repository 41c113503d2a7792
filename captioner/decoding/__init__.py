"""Decoding: grids -> captions with per-word attention, and how good they are.

    search.py      batched beam search (K = 1 is greedy), each word with its attention map
    rules.py       what a search may write next: banned ids, n-gram blocking, a content word once
    sampling.py    captions drawn from the model (self-critical training)
    captioner.py   `Captioner`: the Python API, images or files -> `Caption`s
    caption.py     `Caption`: the words, their scores, each word's map, the JSON
    forced.py      teacher forcing: a given caption's word log-probabilities and maps (`caption(text=)`)
    metrics.py     BLEU, METEOR, ROUGE-L, CIDEr-D through pycocoevalcap
    grounding.py   did the model look at the object a word names?
    scoring.py     captions decoded and scored: what validation and evaluation share
    evaluation.py  caption a split and score it (`captioner evaluate`)
"""
from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {  # name -> its module
    "Caption": "captioner.decoding.caption",
    "Captioner": "captioner.decoding.captioner",
    "Evaluation": "captioner.decoding.evaluation",
    "evaluate_records": "captioner.decoding.evaluation",
    "evaluate_split": "captioner.decoding.evaluation",
    "GroundingResult": "captioner.decoding.grounding",
    "grounding_score": "captioner.decoding.grounding",
    "METRIC_NAMES": "captioner.decoding.metrics",
    "caption_metrics": "captioner.decoding.metrics",
    "Hypothesis": "captioner.decoding.search",
    "beam_search": "captioner.decoding.search",
    "decode": "captioner.decoding.search",
    "score_captions": "captioner.decoding.scoring",
}
__all__ = ["METRIC_NAMES", "Caption", "Captioner", "Evaluation", "GroundingResult", "Hypothesis", "beam_search",
           "caption_metrics", "decode", "evaluate_records", "evaluate_split", "grounding_score", "score_captions"]


def __getattr__(name: str) -> Any:
    """A public name, imported on first use, so that importing one light module of the package
    (`captioner.decoding.caption`) does not import the rest of it, torch included."""
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
