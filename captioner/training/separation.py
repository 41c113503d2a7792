"""The things one caption names look at different places (`train.separation_weight`).

Most captions whose two objects' words peak on one spot name a thing held by another ("a dog with a
toy in its mouth": "dog" and "toy" both on the dog's head), and the word detector that teaches the
maps finds toys where dogs hold them. This term asks it of the maps themselves: for every two
positions of a caption whose words name things (a COCO category's words, the ImageNet table's,
`OTHER_THINGS`), the cosine similarity of their attention maps, averaged over the batch's pairs.
Two maps on disjoint cells cost 0, two equal maps 1; a map may still sit inside another object's
box (a shirt on a man) as long as it peaks on other cells.

Shapes: P packed positions, L regions, V vocabulary, Q positions naming a thing.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from captioner.data.boxes import COCO_WORDS
from captioner.data.vocab import Vocabulary
from captioner.model.decoder import DecoderOutput
from captioner.model.imagenet_words import IMAGENET_WORDS

# Things Flickr-style captions often name that neither COCO's categories nor the ImageNet table cover
OTHER_THINGS = ("toy", "toys", "stick", "sticks", "rope", "leash", "shorts", "pants", "jacket", "jackets", "coat",
                "dress", "costume", "uniform", "camera", "stroller", "wagon", "cart", "paddle", "flag", "sign")


def thing_words(vocab: Vocabulary) -> Tensor:
    """(V,) bool: the words that name a thing one could box (COCO's category words, the words of the
    ImageNet table and `OTHER_THINGS`: dog, man, ball, bench, shirt, toy...), not stuff, colours or actions."""
    names = {w for words in COCO_WORDS.values() for w in words} | set(IMAGENET_WORDS) | set(OTHER_THINGS)
    return torch.tensor([i >= 4 and vocab.word(i) in names for i in range(len(vocab))])


def separation(out: DecoderOutput, targets: Tensor, things: Tensor) -> Tensor:
    """Mean cosine similarity of the attention maps of every two positions of one caption whose words
    name things (0 when no caption of the batch names two).

    Args:
        out: the packed pass: alphas (P, L), caption (P,) each position's caption.
        targets: (P,) the word each position writes.
        things: (V,) bool, the words that name things (`thing_words`).
    """
    named = things.to(targets.device)[targets]  # (P,)
    maps = F.normalize(out.alphas[named].float(), dim=-1)  # (Q, L) unit length
    caption = out.caption[named]  # (Q,)
    same = (caption[:, None] == caption[None, :]).triu(diagonal=1)  # (Q, Q) pairs i < j of one caption
    if not bool(same.any()):
        return out.alphas.new_zeros((), dtype=torch.float32)
    return (maps @ maps.T)[same].mean()
