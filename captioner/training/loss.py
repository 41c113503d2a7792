"""Training loss: cross-entropy over real tokens plus optional attention terms: the doubly
stochastic coverage term (every region looked at about once per caption), an entropy penalty
(each word looks at few regions), the word detector's teacher (`concept_weight`) and box
supervision (`box_weight`).

Shapes: B captions, T + 1 tokens, P real (scored) positions, V vocabulary, L regions.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from captioner.config import TrainConfig
from captioner.data.vocab import Vocabulary
from captioner.model.concepts import noisy_or
from captioner.model.decoder import DecoderOutput
from captioner.training.boxes import box_attention
from captioner.training.teachers import (ClothingPrior, ImageNetTeacher, Teacher, content_words,
                                         detector_teacher, person_words)


class LossOutput(NamedTuple):
    total: Tensor  # scalar: xent + coverage_weight * coverage + entropy_weight * entropy
    xent: Tensor  # scalar: mean cross-entropy per real token
    coverage: Tensor  # scalar: mean over captions and regions of (1 - sum_t alpha)^2 (0 when its weight is 0)
    entropy: Tensor  # scalar: mean entropy (nats) of a real token's attention map (0 when its weight is 0)
    reward: Tensor  # scalar: mean CIDEr-D reward of the sampled captions (self-critical training; else 0)
    box: Tensor  # scalar: mean -log mass of a boxed object's word map on its cells (0 without box supervision)


class Criterion(Protocol):
    """A run's training loss of a packed pass (`build_criterion`)."""

    def __call__(self, out: DecoderOutput, tokens: Tensor, box_cells: Tensor | None = None,
                 images: Tensor | None = None) -> LossOutput:
        """(packed output, (B, T + 1) tokens, (B, T, L) bool box cells or None, (N,) image ids of the
        pass's cached grids or None) -> the loss terms."""

    def detector_outputs(self, tokens: Tensor) -> Tensor | bool:
        """The word detector outputs the decoder must score for a batch of (B, T + 1) captions
        (its `detect` argument)."""


def caption_loss(
    out: DecoderOutput,
    tokens: Tensor,
    coverage_weight: float = 0.0,
    entropy_weight: float = 0.0,
    label_smoothing: float = 0.0,
    concept_weight: float = 0.0,
    teacher: Teacher | None = None,
    slots: Tensor | None = None,
    box_cells: Tensor | None = None,
    box_weight: float = 0.0,
    images: Tensor | None = None,
) -> LossOutput:
    """Cross-entropy over real tokens + `coverage_weight * mean_regions (1 - sum_t alpha)^2` (Show,
    Attend and Tell's doubly stochastic term, averaged so it does not grow with the grid) +
    `entropy_weight * mean_t H(alpha_t)`. A term whose weight is 0 is not computed.

    Args:
        out: the decoder's packed pass: logits (P, V) and alphas (P, L), row p predicting
            tokens[out.caption[p], out.step[p] + 1]. Padding was never computed, so never counts.
        tokens: (B, T + 1) the captions the decoder read.
        coverage_weight: asks every region to be looked at about once over the caption.
        entropy_weight: asks each word to commit to few regions instead of blending several
            objects into one look.
        label_smoothing: passed to cross-entropy.
        concept_weight: pulls the map of each word `teacher` knows towards the teacher's map; the
            decoder's word detector's own loss (`concept_detection`) is added whenever it has one.
        teacher: where each word is (captioner.training.teachers); None = the decoder's detector,
            for every word but the special ids.
        slots: (V,) the detector output of each word (`concept_slots`); None = its own.
        box_cells: (B, T, L) bool, the cells of the boxed object each position's word names
            (`BoxTargets.cells`); with `box_weight`, those words' maps are pulled into them.
        images: (N,) int64 the image id of each of the pass's grids when they are a frozen encoder's
            cached ones (a teacher may keep what it computed of a photo), else None.
    """
    targets = tokens[out.caption, out.step + 1]  # (P,)
    xent = F.cross_entropy(out.logits.float(), targets, label_smoothing=label_smoothing)
    zero = xent.new_zeros(())
    coverage = entropy = box = zero
    if coverage_weight:
        B, L = tokens.size(0), out.alphas.size(-1)
        looked = torch.zeros(B, L, device=tokens.device).index_add_(0, out.caption, out.alphas.float())  # (B, L)
        coverage = ((1.0 - looked) ** 2).mean()
    if entropy_weight:
        alphas = out.alphas.float()  # (P, L)
        # clamped inside the log: 0 log 0 = 0 with a finite gradient (xlogy's would be infinite)
        entropy = -(alphas * alphas.clamp_min(1e-12).log()).sum(dim=-1).mean()
    total = xent + coverage_weight * coverage + entropy_weight * entropy
    if out.concepts is not None:
        total = total + concept_detection(out.concepts, tokens, out.rows, slots, out.detected)
    if concept_weight:
        teach = teacher or detector_teacher(torch.arange(out.logits.size(-1)) >= 4)
        total = total + concept_weight * concept_attention(out, targets, teach, images)
    if box_weight and box_cells is not None:
        box = box_attention(out, box_cells)
        total = total + box_weight * box
    return LossOutput(total, xent, coverage, entropy, zero, box)


def concept_detection(concepts: Tensor, tokens: Tensor, rows: Tensor, slots: Tensor | None = None,
                      detected: Tensor | None = None) -> Tensor:
    """Multiple-instance learning of the word detector: a photo shows word w when some region does,
    p(w) = 1 - prod_regions (1 - sigmoid(s_lw)) (noisy-OR), trained with binary cross-entropy against
    the words of the photo's captions in the batch (<pad>/<start>/<end>/<unk> excluded).

    Args:
        concepts: (N, L, K) region scores. tokens: (B, T + 1) captions. rows: (B,) their photos.
        slots: (V,) the output standing for each word (words of a group share one); None = its own.
            Only the outputs some word stands for are trained.
        detected: (K,) the outputs `concepts` holds (`DecoderOutput.detected`); None = all, K = V.
    """
    N, _, K = concepts.shape
    outputs = torch.arange(K, device=concepts.device) if detected is None else detected.to(concepts.device)  # (K,)
    slot = tokens if slots is None else slots.to(tokens.device)[tokens]  # (B, T + 1)
    named = (slot[:, :, None] == outputs).any(dim=1).float()  # (B, K): caption b uses output k
    present = torch.zeros(N, K, device=concepts.device).index_add_(0, rows, named).clamp_(max=1.0)  # (N, K)
    log_present, log_absent = noisy_or(concepts)  # (N, K) log p, log (1 - p)
    nll = -(present * log_present + (1 - present) * log_absent)  # (N, K)
    used = outputs >= 4  # the four special ids are never words of a photo
    if slots is not None:
        used &= slots.to(concepts.device)[outputs] == outputs
    return nll[:, used].mean()


def detector_outputs(tokens: Tensor, slots: Tensor | None, vocab_size: int, negatives: int) -> Tensor | bool:
    """The word detector outputs a batch trains (`concept_detection`), for the decoder's `detect`:
    the slot of every word the batch's captions use (the outputs the teacher reads, and each other
    photo of the batch is a negative for them) and about `negatives` others drawn at random, so that
    every output keeps learning where its word is absent. Scoring all V outputs at every region is a
    third of a 12x12 cross-entropy step for a 2,500-word vocabulary; ~600 of them cost a fifth of that.

    Args:
        tokens: (B, T + 1) the batch's captions. slots: (V,) the output of each word (None = its own).
        negatives: how many outputs to draw beside the batch's; < 0 = all (returns True).
    Returns:
        (K,) ascending int64 ids, or True (all V).
    """
    if negatives < 0:
        return True
    drawn = torch.randint(4, vocab_size, (negatives,), device=tokens.device)  # (negatives,)
    ids = torch.cat([tokens.flatten(), drawn])
    if slots is not None:
        ids = slots.to(tokens.device)[ids]
    ids = torch.unique(ids)  # (K,) ascending
    return ids[ids >= 4]


def concept_attention(out: DecoderOutput, targets: Tensor, teacher: Teacher, images: Tensor | None = None) -> Tensor:
    """Cross-entropy from the teacher's map of each word it knows (softmax over regions, detached:
    the teacher is not pulled towards the student) to the attention of the step writing that word.

    Args:
        out: the packed pass. targets: (P,) the word each position writes. teacher: see `Teacher`.
        images: (N,) the image ids of the pass's cached grids, or None (see `caption_loss`).
    """
    keep, scores = teacher(out, targets, images)  # (P,), (P', L)
    if not bool(keep.any()):
        return out.alphas.new_zeros(())
    target = torch.softmax(scores.detach(), dim=-1)  # (P', L)
    return -(target * out.alphas[keep].float().clamp_min(1e-12).log()).sum(dim=-1).mean()


def build_teacher(cfg: TrainConfig, vocab: Vocabulary | None, encoder: str | None,
                  slots: Tensor | None = None) -> Teacher | None:
    """The teacher `train.concept_teacher` names, for the run's vocabulary and encoder (None when
    `train.concept_weight` is 0)."""
    if not cfg.concept_weight:
        return None
    if vocab is None:
        raise ValueError("concept supervision needs the run's vocabulary")
    if cfg.concept_teacher == "imagenet":
        if encoder is None:
            raise ValueError("the ImageNet teacher needs the run's encoder name")
        return ImageNetTeacher.for_encoder(encoder, vocab)
    if cfg.concept_teacher == "detector+clothing":
        if encoder is None:
            raise ValueError("the clothing prior needs the run's encoder name")
        return detector_teacher(content_words(vocab), slots, person_words(vocab), ClothingPrior.for_encoder(encoder))
    return detector_teacher(content_words(vocab), slots)


class CaptionCriterion:
    """`caption_loss` with a run's weights and teacher (`build_criterion`), and the detector outputs
    each batch trains (`detector_outputs`, `train.concept_negatives`)."""

    def __init__(self, cfg: TrainConfig, teacher: Teacher | None, slots: Tensor | None, vocab_size: int | None) -> None:
        self.loss = functools.partial(
            caption_loss, coverage_weight=cfg.coverage_weight, entropy_weight=cfg.entropy_weight,
            label_smoothing=cfg.label_smoothing, concept_weight=cfg.concept_weight, teacher=teacher, slots=slots,
            box_weight=cfg.box_weight)
        self.slots, self.vocab_size, self.negatives = slots, vocab_size, cfg.concept_negatives

    def __call__(self, out: DecoderOutput, tokens: Tensor, box_cells: Tensor | None = None,
                 images: Tensor | None = None) -> LossOutput:
        return self.loss(out, tokens, box_cells=box_cells, images=images)

    def detector_outputs(self, tokens: Tensor) -> Tensor | bool:
        if self.vocab_size is None or self.negatives + 4 >= self.vocab_size:
            return True
        return detector_outputs(tokens, self.slots, self.vocab_size, self.negatives)


def build_criterion(cfg: TrainConfig, vocab: Vocabulary | None = None, encoder: str | None = None,
                    slots: Tensor | None = None) -> Criterion:
    """The run's loss (`CaptionCriterion`): `caption_loss` with the config's weights and teacher
    (`build_teacher`). `slots` (V,) is the detector output each word trains: the model's own
    (`AttentionDecoder.detector_slots`, which decoding reads); None = each word its own. Without `vocab`
    the detector scores every output at every step."""
    teacher = build_teacher(cfg, vocab, encoder, slots)
    return CaptionCriterion(cfg, teacher, slots, len(vocab) if vocab is not None else None)
