import torch

from captioner.model.attention import AttentionPool, BahdanauAttention
from captioner.model.memory import Memory

B, L, D, H, A = 3, 10, 16, 12, 8


def _inputs(regions: int = L):
    return torch.randn(B, regions, D), torch.randn(B, H)


def test_alpha_sums_to_one_and_the_context_is_the_weighted_mean():
    attn = BahdanauAttention(D, H, A)
    features, hidden = _inputs()
    keys = attn.keys(features)
    alpha = attn(keys, hidden)
    context = Memory(features, keys).read(alpha)
    assert context.shape == (B, D) and alpha.shape == (B, L)
    torch.testing.assert_close(alpha.sum(-1), torch.ones(B))
    torch.testing.assert_close(context, (alpha.unsqueeze(-1) * features).sum(1))


def test_precomputed_keys_equal_per_step_formula():
    attn = BahdanauAttention(D, H, A)
    features, hidden = _inputs()
    alpha = attn(attn.keys(features), hidden)
    # e = v . tanh(W1 f + W2 h), written out directly
    e = attn.score(torch.tanh(attn.key_proj(features) + attn.query_proj(hidden)[:, None])).squeeze(-1)
    torch.testing.assert_close(alpha, torch.softmax(e, -1))


def test_gradients_are_those_of_the_tanh_formula():
    """The scores' own backward (`_AdditiveScores`): every weight's and input's gradient must be what
    autograd gives for softmax(v · tanh(W1 f + W2 h)) written out."""
    torch.manual_seed(0)
    attn = BahdanauAttention(D, H, A).double()
    features, hidden = (x.double().requires_grad_(True) for x in _inputs())
    weights = torch.randn(B, L, dtype=torch.float64)

    def gradients(alpha_of):
        attn.zero_grad()
        features.grad = hidden.grad = None
        (alpha_of() * weights).sum().backward()
        return [features.grad.clone(), hidden.grad.clone()] + [p.grad.clone() for p in attn.parameters()]

    fused = gradients(lambda: attn(attn.keys(features), hidden))
    written = gradients(lambda: torch.softmax(attn.score(torch.tanh(
        attn.key_proj(features) + attn.query_proj(hidden)[:, None])).squeeze(-1), -1))
    for f, w in zip(fused, written):
        torch.testing.assert_close(f, w)


def test_an_images_keys_serve_all_its_rows():
    """Keys (N, L, A) read by S rows each (an image's beams): the maps of a per-row copy."""
    attn = BahdanauAttention(D, H, A)
    features, _ = _inputs()
    hidden = torch.randn(B * 4, H)  # 4 rows per image
    keys = attn.keys(features)  # (B, L, A)
    torch.testing.assert_close(attn(keys, hidden), attn(keys.repeat_interleave(4, dim=0), hidden))


def test_softmax_runs_in_float32_under_bfloat16():
    """bf16 features and state (as under autocast): the weights come out of a float32 softmax, as
    float32, and sum to 1 to float32 precision; a bf16 softmax's sums are off by up to ~1e-2."""
    attn = BahdanauAttention(D, H, A).to(torch.bfloat16)
    features, hidden = (x.bfloat16() for x in _inputs(225))  # a 15x15 grid
    keys = attn.keys(features)
    alpha = attn(keys, hidden)
    context = Memory(features, keys).read(alpha)
    assert alpha.dtype == torch.float32 and context.dtype == torch.bfloat16
    torch.testing.assert_close(alpha.sum(-1), torch.ones(B), atol=1e-6, rtol=0)
    query = 2 * attn.query_proj(hidden).unsqueeze(1)
    scores = 2 * attn.score(torch.sigmoid(keys + query)).squeeze(-1)  # the module's own bf16 scores
    torch.testing.assert_close(alpha, torch.softmax(scores.float(), -1), atol=1e-7, rtol=0)
    assert (torch.softmax(scores, -1).float().sum(-1) - 1).abs().max() > 1e-6  # what bf16 would give


def test_attention_pooling_is_a_convex_combination_of_the_regions():
    features, _ = _inputs()
    pooled = AttentionPool(D, A)(features)
    assert pooled.shape == (B, D)
    assert torch.all(pooled <= features.max(1).values + 1e-6) and torch.all(pooled >= features.min(1).values - 1e-6)
