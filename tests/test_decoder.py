import dataclasses

import pytest
import torch

from captioner.config import DecoderConfig
from captioner.decoder import AttentionDecoder
from captioner.loss import caption_loss

B, L, D, V = 4, 9, 16, 30
CFG = DecoderConfig(embed_dim=8, hidden_dim=12, attention_dim=10, dropout=0.0, feature_dim=10)
GRID = (3, 3)  # L = 9


def _batch():
    features = torch.randn(B, L, D)
    lengths = torch.tensor([6, 3, 4, 1])  # words + <end>
    tokens = torch.zeros(B, 7, dtype=torch.long)  # (B, T + 1)
    tokens[:, 0] = 1
    for b, n in enumerate(lengths.tolist()):
        tokens[b, 1:n] = torch.randint(4, V, (n - 1,))
        tokens[b, n] = 2
    return features, tokens, lengths


@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("pooling", ["mean", "attention"])
def test_shapes_no_nans_and_alpha_rows_sum_to_one(gate, pooling):
    dec = AttentionDecoder(V, D, dataclasses.replace(CFG, gate=gate, init_pooling=pooling), grid=GRID)
    features, tokens, _ = _batch()
    out = dec(features, tokens)
    assert out.logits.shape == (B, 6, V) and out.alphas.shape == (B, 6, L)
    assert torch.isfinite(out.logits).all()
    torch.testing.assert_close(out.alphas.sum(-1), torch.ones(B, 6))


def test_every_trainable_parameter_gets_a_gradient():
    dec = AttentionDecoder(V, D, dataclasses.replace(CFG, init_pooling="attention"), grid=GRID)
    features, tokens, lengths = _batch()
    out = dec(features, tokens)
    caption_loss(out.logits, tokens[:, 1:], lengths, out.alphas).total.backward()
    for name, p in dec.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_teacher_forced_forward_equals_stepping():
    dec = AttentionDecoder(V, D, CFG, grid=GRID).eval()
    features, tokens, _ = _batch()
    out = dec(features, tokens)
    memory = dec.memory(features)
    hidden = dec.init_hidden(memory)
    for t in range(tokens.size(1) - 1):
        step = dec.step(tokens[:, t], hidden, memory)
        hidden = step.hidden
        torch.testing.assert_close(step.logits, out.logits[:, t])
        torch.testing.assert_close(step.alpha, out.alphas[:, t])


def test_masked_regions_get_no_attention_and_do_not_change_outputs():
    dec = AttentionDecoder(V, D, dataclasses.replace(CFG, init_pooling="attention"), grid=GRID).eval()
    features, tokens, _ = _batch()
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[:, 5:] = False
    out = dec(features, tokens, mask=mask)
    assert torch.all(out.alphas[..., 5:] == 0)
    padded = features.clone()
    padded[:, 5:] = 99.0
    torch.testing.assert_close(dec(padded, tokens, mask=mask).logits, out.logits)


def test_scheduled_sampling_feeds_own_predictions():
    dec = AttentionDecoder(V, D, CFG, grid=GRID).eval()
    features, tokens, _ = _batch()
    teacher = dec(features, tokens).logits
    torch.manual_seed(0)
    own = dec(features, tokens, sampling_prob=1.0).logits
    torch.testing.assert_close(own[:, 0], teacher[:, 0])  # the first step always reads <start>
    assert not torch.allclose(own[:, 1:], teacher[:, 1:])


def test_position_embeddings_let_attention_tell_identical_regions_apart():
    """Two images whose regions are all the same vector: without position the attention must be
    uniform; with it, regions differ and the context depends on where they are."""
    features = torch.randn(1, 1, D).expand(2, L, D)
    tokens = torch.tensor([[1, 5, 2], [1, 5, 2]])
    flat = AttentionDecoder(V, D, dataclasses.replace(CFG, position=False)).eval()
    torch.testing.assert_close(flat(features, tokens).alphas, torch.full((2, 2, L), 1.0 / L))
    placed = AttentionDecoder(V, D, CFG, grid=GRID).eval()
    alphas = placed(features, tokens).alphas
    assert alphas[0, 0].std() > 0
    with pytest.raises(ValueError, match="3x3 grid"):
        placed(torch.randn(1, 16, D), tokens[:1])


def test_feature_projection_happens_once_per_image():
    dec = AttentionDecoder(V, D, CFG, grid=GRID)
    memory = dec.memory(torch.randn(B, L, D))
    assert memory.features.shape == (B, L, CFG.feature_dim) and memory.keys.shape == (B, L, CFG.attention_dim)
