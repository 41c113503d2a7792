"""Gradient relevance maps (`decoding/relevance.py`, `evaluate --relevance`): each word's evidence
over the regions, labelled apart from the attention the decoder used."""
import dataclasses

import pytest
import torch

from captioner.config import DecoderConfig
from captioner.decoding.relevance import relevance_maps
from captioner.model.decoder import AttentionDecoder

N, L, D, V = 3, 9, 16, 30
PAD, START, END = 0, 1, 2
CFG = DecoderConfig(embed_dim=8, hidden_dim=12, attention_dim=10, dropout=0.0, feature_dim=0, position=False)


def _decoder(**layout) -> AttentionDecoder:
    torch.manual_seed(0)
    return AttentionDecoder(V, D, dataclasses.replace(CFG, **layout), grid=(3, 3)).eval()


def _captions(*words):
    T = max(len(w) for w in words)
    tokens = torch.tensor([[START, *w, END] + [PAD] * (T - len(w)) for w in words])
    return tokens, torch.tensor([len(w) + 1 for w in words])


def test_maps_sum_to_one_are_never_negative_and_padding_is_zero():
    dec, features = _decoder(), torch.randn(2, L, D)
    tokens, lengths = _captions([5, 6, 7, 8], [9], [10, 11])
    maps = relevance_maps(dec, features, tokens, lengths, rows=torch.tensor([1, 0, 1]))
    assert maps.shape == (3, 5, L) and bool((maps >= 0).all())
    for b, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(maps[b, :n].sum(-1), torch.ones(n))
        assert not maps[b, n:].any()


@pytest.mark.parametrize("layout", [{"attend": "before"}, {"attend": "after", "global_context": True}])
def test_a_region_without_features_has_no_relevance(layout):
    """Gradient x input: the evidence sits where the features are. Every region but two is zero, so
    a map lies on those two (a plain gradient map would spread over all nine), or is even where
    neither speaks for the word."""
    dec = _decoder(**layout)
    features = torch.zeros(1, L, D)
    features[0, 2], features[0, 6] = torch.randn(D), torch.randn(D)
    maps = relevance_maps(dec, features, *_captions([5, 6, 7, 8, 9, 10]))[0]  # (7, L)
    even = torch.isclose(maps, torch.full_like(maps, 1 / L)).all(-1)  # (7,)
    assert int((~even).sum()) >= 3
    torch.testing.assert_close(maps[~even][:, [2, 6]].sum(-1), torch.ones(int((~even).sum())))


def test_a_caption_gets_the_same_maps_alone_as_in_a_batch_sharing_its_image():
    """Captions of one image in one batch must not pool their gradients."""
    dec, features = _decoder(), torch.randn(1, L, D)
    words = [[5, 6, 7, 8], [9, 10]]
    together = relevance_maps(dec, features, *_captions(*words), rows=torch.tensor([0, 0]))
    for b, w in enumerate(words):
        alone = relevance_maps(dec, features, *_captions(w))
        torch.testing.assert_close(together[b, : len(w) + 1], alone[0], atol=1e-6, rtol=0)


def test_the_map_follows_the_region_that_decides_the_word():
    """Make one region's feature the only thing the readout of a word depends on: that region gets
    the word's relevance."""
    dec = _decoder(attend="before", gate=False, init_pooling="none")
    features = torch.randn(1, L, D) * 0.01
    features[0, 4] = 3.0  # a strong region
    maps = relevance_maps(dec, features, *_captions([5]))
    assert int(maps[0, 0].argmax()) == 4


def test_an_ensemble_of_a_decoder_with_itself_has_the_decoders_maps():
    from captioner.decoding.ensemble import EnsembleDecoder

    dec, features = _decoder(), torch.randn(2, L, D)
    tokens, lengths = _captions([5, 6, 7], [8])
    torch.testing.assert_close(relevance_maps(EnsembleDecoder([dec, dec]).eval(), features, tokens, lengths),
                               relevance_maps(dec, features, tokens, lengths), atol=1e-6, rtol=0)
