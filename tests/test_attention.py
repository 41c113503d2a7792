import torch

from captioner.attention import AttentionPool, BahdanauAttention, masked_mean

B, L, D, H, A = 3, 10, 16, 12, 8


def _inputs():
    features = torch.randn(B, L, D)
    hidden = torch.randn(B, H)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, 7:] = False  # image 0 has 3 padded regions
    mask[2, 1:] = False  # image 2 has a single real region
    return features, hidden, mask


def test_alpha_sums_to_one_and_is_zero_on_masked_regions():
    attn = BahdanauAttention(D, H, A)
    features, hidden, mask = _inputs()
    context, alpha = attn(attn.keys(features), features, hidden, mask)
    assert context.shape == (B, D) and alpha.shape == (B, L)
    torch.testing.assert_close(alpha.sum(-1), torch.ones(B))
    assert torch.all(alpha[~mask] == 0)
    torch.testing.assert_close(alpha[2, 0], torch.tensor(1.0))
    torch.testing.assert_close(context[2], features[2, 0])


def test_precomputed_keys_equal_per_step_formula():
    attn = BahdanauAttention(D, H, A)
    features, hidden, _ = _inputs()
    _, alpha = attn(attn.keys(features), features, hidden)
    # e = v . tanh(W1 f + W2 h), written out directly
    e = attn.score(torch.tanh(attn.key_proj(features) + attn.query_proj(hidden)[:, None])).squeeze(-1)
    torch.testing.assert_close(alpha, torch.softmax(e, -1))


def test_softmax_runs_in_float32_under_bfloat16():
    attn = BahdanauAttention(D, H, A).to(torch.bfloat16)
    features, hidden, mask = _inputs()
    features, hidden = features.bfloat16(), hidden.bfloat16()
    context, alpha = attn(attn.keys(features), features, hidden, mask)
    assert alpha.dtype == torch.bfloat16 and context.dtype == torch.bfloat16
    assert torch.isfinite(alpha.float()).all()
    torch.testing.assert_close(alpha.float().sum(-1), torch.ones(B), atol=1e-2, rtol=0)


def test_pooling_ignores_masked_regions():
    features, _, mask = _inputs()
    features_garbage = features.clone()
    features_garbage[~mask] = 1e4  # padded regions must not leak into the pooled vector
    torch.testing.assert_close(masked_mean(features, mask), masked_mean(features_garbage, mask))
    pool = AttentionPool(D, A)
    torch.testing.assert_close(pool(features, mask), pool(features_garbage, mask))
