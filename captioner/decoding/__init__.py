"""Decoding: grids -> captions with per-word attention, and how good they are.

    search.py      batched beam search (K = 1 is greedy), each word with its attention map
    captioner.py   `Captioner`: the Python API, images or files -> `Caption`s
    caption.py     `Caption`: the words, their scores, each word's map, the JSON
    forced.py      teacher forcing: a given caption's word log-probabilities and maps (`caption(text=)`)
    metrics.py     BLEU, METEOR, ROUGE-L, CIDEr-D through pycocoevalcap
    grounding.py   did the model look at the object a word names?
    evaluation.py  caption a split and score it (`captioner evaluate`)
"""
from captioner.decoding.captioner import Caption, Captioner
from captioner.decoding.evaluation import Evaluation, evaluate_checkpoint, evaluate_records
from captioner.decoding.grounding import GroundingResult, grounding_score
from captioner.decoding.metrics import METRIC_NAMES, caption_metrics
from captioner.decoding.search import Hypothesis, beam_search, decode

__all__ = ["METRIC_NAMES", "Caption", "Captioner", "Evaluation", "GroundingResult", "Hypothesis", "beam_search",
           "caption_metrics", "decode", "evaluate_checkpoint", "evaluate_records", "grounding_score"]
