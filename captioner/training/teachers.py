"""Where a word is in a photo, without boxes: the teachers that weak attention supervision pulls a
content word's map towards (`train.concept_weight`, `train.concept_teacher`).

    detector_teacher(content)          the decoder's own word detector (multiple-instance learning)
    detector_teacher(content, people, ClothingPrior(...))
                                       the same, a person's map weighted by where the classifier sees clothes
    ImageNetTeacher(weights, vocab)    the encoder's ImageNet classifier, per region (class activation maps)

A teacher takes the packed decoder output, the word of each position (P,) and the image ids of the
pass's grids (N,) (None when the grids are not a frozen encoder's cached ones) and returns which
positions it teaches (P,) bool and, for those, a score per region (P', L) whose softmax is the map
to pull towards. Shapes: N photos, L regions, D encoder width, V vocabulary, C = 1000 classes.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from captioner.config import ConfigError
from captioner.data.boxes import COCO_WORDS
from captioner.data.vocab import Vocabulary
from captioner.model.decoder import DecoderOutput
from captioner.model.imagenet_words import CLOTHING, IMAGENET_WORDS

# (out, words (P,), image ids of out's grids (N,) or None) -> (keep (P,), scores (P', L))
Teacher = Callable[[DecoderOutput, Tensor, "Tensor | None"], tuple[Tensor, Tensor]]


def content_words(vocab: Vocabulary) -> Tensor:
    """(V,) bool: the words a map is pulled for (not function words, not the special ids)."""
    mask = torch.zeros(len(vocab), dtype=torch.bool)
    mask[vocab.content_ids()] = True
    return mask


def person_words(vocab: Vocabulary) -> Tensor:
    """(V,) bool: the words that name a person (COCO's person category: man, woman, boy, people...)."""
    return torch.tensor([vocab.word(i) in COCO_WORDS["person"] for i in range(len(vocab))])


def detector_teacher(content: Tensor, slots: Tensor | None = None, people: Tensor | None = None,
                     prior: ClothingPrior | None = None) -> Teacher:
    """The word detector's region scores (`out.concepts`, detached) for every content word, read at
    each word's slot (`concept_slots`; None = its own id). The pass must have scored the slot of every
    word it wrote (`detector_outputs` does). With `prior`, the scores of the words `people` (V,) bool
    names get its log P(clothing) added: the teacher's map is the detector's times the classifier's
    probability that a region shows what people wear, renormalised. The detector alone learns "a
    photo with people" as readily from the street they stand on as from them."""

    def teach(out: DecoderOutput, words: Tensor, images: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if out.concepts is None:
            raise ValueError("the detector teacher needs model.decoder.concepts")
        keep = content.to(words.device)[words]  # (P,)
        photo = out.rows[out.caption[keep]]  # (P',)
        slot = words[keep] if slots is None else slots.to(words.device)[words[keep]]  # (P',)
        if out.detected is not None:  # the column of each slot among the outputs the pass scored
            slot = torch.searchsorted(out.detected.to(words.device), slot)
        scores = out.concepts.detach().float()[photo, :, slot]  # (P', L)
        if prior is not None and people is not None:
            person = people.to(words.device)[words[keep]]  # (P',)
            if bool(person.any()):
                if out.grid is None:
                    raise ValueError("the clothing prior needs the encoder's grid in the decoder output")
                needed, where = torch.unique(photo[person], return_inverse=True)  # (N',), (P'',)
                logp = prior(out.grid[needed], None if images is None else images[needed])  # (N', L)
                scores[person] += logp[where]
        return keep, scores

    return teach


def lite_classifier(name: str, teacher: str) -> tuple[Tensor, Tensor]:
    """The ImageNet classifier that ships with EfficientNet-Lite encoder `name`: weight (C, D), bias
    (C,), for `train.concept_teacher: teacher` (a one-line ConfigError for any other encoder)."""
    from captioner.model.weights import LITE_NAMES, efficientnet_lite_state_dict

    if name not in LITE_NAMES:
        raise ConfigError(f"config key 'train.concept_teacher': {teacher!r} needs the classifier of an "
                          f"EfficientNet-Lite encoder ({', '.join(LITE_NAMES)}), not {name!r}")
    state = efficientnet_lite_state_dict(name)
    return state["classifier.weight"], state["classifier.bias"]


def last_stage(grid: Tensor, weight: Tensor) -> Tensor:
    """(N, L, D') grids -> (N, L, D): the last stage's channels, which the classifier weight (C, D)
    reads; a two-scale grid (`model.encoder.two_scale`) ends with them."""
    return grid[..., grid.size(-1) - weight.size(1):]


class ClothingPrior:
    """Where people are, by what they wear: log P(clothing | region), the summed probability of the
    `CLOTHING` classes under the encoder's ImageNet classifier applied to each region alone (softmax
    over all C classes). A photo's prior is kept by image id once computed: a frozen encoder's cached
    grid never changes, and the (N·L, D) x (D, C) product would cost half a 12x12 training step."""

    def __init__(self, weight: Tensor, bias: Tensor) -> None:
        """weight (C, D), bias (C,): the classifier."""
        self.weight, self.bias = weight.float(), bias.float()
        self.clothing = torch.tensor(CLOTHING)
        self.known: dict[int, Tensor] = {}  # image id -> (L,) log P(clothing)

    @classmethod
    def for_encoder(cls, name: str) -> ClothingPrior:
        return cls(*lite_classifier(name, "detector+clothing"))

    def __call__(self, grid: Tensor, images: Tensor | None = None) -> Tensor:
        """(N, L, D) grids -> (N, L) log P(clothing) at each region. `images` (N,) int64: the grids'
        image ids, to compute each photo once (None: compute all, keep nothing)."""
        if images is None:
            return self._compute(grid.detach())
        ids = images.tolist()
        todo = [n for n, i in enumerate(ids) if i not in self.known]
        if todo:
            for n, row in zip(todo, self._compute(grid.detach()[todo]).cpu()):
                self.known[ids[n]] = row
        return torch.stack([self.known[i] for i in ids]).to(grid.device)  # (N, L)

    def _compute(self, grid: Tensor) -> Tensor:
        w, b = self.weight.to(grid.device), self.bias.to(grid.device)
        logp = torch.log_softmax(last_stage(grid, w).float() @ w.T + b, dim=-1)  # (N, L, C)
        return logp[..., self.clothing.to(grid.device)].logsumexp(dim=-1)  # (N, L)


class ImageNetTeacher:
    """Class activation maps of the encoder's ImageNet classifier: for a word of `IMAGENET_WORDS`, the
    log-sum-exp over its classes of the classifier's logit at each region (the classifier of a
    mean-pooled grid applied to each region alone)."""

    def __init__(self, weight: Tensor, bias: Tensor, vocab: Vocabulary) -> None:
        """weight (C, D), bias (C,): the classifier; vocab: the caption words."""
        self.weight, self.bias = weight.float(), bias.float()
        self.classes = torch.zeros(len(vocab), weight.size(0), dtype=torch.bool)  # (V, C)
        for word, classes in IMAGENET_WORDS.items():
            if word in vocab:
                self.classes[vocab.id(word), list(classes)] = True
        self.known = self.classes.any(dim=1)  # (V,)

    @classmethod
    def for_encoder(cls, name: str, vocab: Vocabulary) -> ImageNetTeacher:
        return cls(*lite_classifier(name, "imagenet"), vocab)

    def __call__(self, out: DecoderOutput, words: Tensor, images: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if out.grid is None:
            raise ValueError("the ImageNet teacher needs the encoder's grid in the decoder output")
        device = out.grid.device
        keep = self.known.to(device)[words]  # (P,)
        photo = out.rows[out.caption[keep]]  # (P',)
        w = self.weight.to(device)
        logits = last_stage(out.grid.detach(), w).float() @ w.T + self.bias.to(device)  # (N, L, C)
        mask = self.classes.to(device)[words[keep]]  # (P', C)
        per_class = logits[photo].masked_fill(~mask[:, None, :], float("-inf"))  # (P', L, C)
        return keep, per_class.logsumexp(dim=-1)  # (P', L)
