import copy
import dataclasses

import pytest
import torch

from captioner.config import ConfigError, DecoderConfig
from captioner.model.decoder import AttentionDecoder
from captioner.training.loss import caption_loss

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


@pytest.mark.parametrize("attend", ["before", "after"])
@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("pooling", ["mean", "attention", "none"])
def test_shapes_no_nans_and_alpha_rows_sum_to_one(gate, pooling, attend):
    dec = AttentionDecoder(V, D, dataclasses.replace(CFG, gate=gate, init_pooling=pooling, attend=attend), grid=GRID)
    features, tokens, lengths = _batch()
    out = dec(features, tokens, lengths)
    P = int(lengths.sum())  # only real positions are computed
    assert out.logits.shape == (P, V) and out.alphas.shape == (P, L)
    assert torch.isfinite(out.logits).all()
    torch.testing.assert_close(out.alphas.sum(-1), torch.ones(P))
    # time-major, longest caption first: step 0 of every caption, then step 1 of those still going...
    assert out.step.tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 4, 5]
    assert out.caption.tolist()[:4] == [0, 2, 1, 3]


@pytest.mark.parametrize("attend", ["before", "after"])
@pytest.mark.parametrize("pooling", ["mean", "attention", "none"])
@pytest.mark.parametrize("gate, position, feature_dim, scene", [(True, True, 10, True), (False, False, 0, False)])
def test_every_parameter_gets_a_gradient(attend, pooling, gate, position, feature_dim, scene):
    """Under DDP a parameter that never gets a gradient stops training at the second step."""
    cfg = dataclasses.replace(CFG, init_pooling=pooling, attend=attend, gate=gate, position=position,
                              feature_dim=feature_dim, global_context=scene, concepts=scene)
    dec = AttentionDecoder(V, D, cfg, grid=GRID)
    features, tokens, lengths = _batch()
    caption_loss(dec(features, tokens, lengths), tokens, concept_weight=1.0 if scene else 0.0).total.backward()
    for name, p in dec.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("attend", ["before", "after"])
@pytest.mark.parametrize("scene", [False, True], ids=["", "global-context"])
def test_teacher_forced_forward_equals_stepping(attend, scene):
    dec = AttentionDecoder(V, D, dataclasses.replace(CFG, attend=attend, global_context=scene), grid=GRID).eval()
    features, tokens, lengths = _batch()
    out = dec(features, tokens, lengths)
    T = tokens.size(1) - 1
    logits, alphas = out.padded(out.logits, B, T), out.padded(out.alphas, B, T)  # (B, T, V), (B, T, L)
    memory = dec.memory(features)
    hidden = dec.init_hidden(memory)
    for t in range(T):
        step = dec.step(tokens[:, t], hidden, memory)
        hidden = step.hidden
        going = lengths > t  # the packed pass computes only these
        torch.testing.assert_close(step.logits[going], logits[going, t])
        torch.testing.assert_close(step.alpha[going], alphas[going, t])
        assert torch.all(logits[~going, t] == 0)


@pytest.mark.parametrize("attend", ["before", "after"])
@pytest.mark.parametrize("rows", [None, [1, 0, 1, 1]], ids=["an-image-each", "images-shared"])
def test_teacher_forced_gradients_equal_stepping(attend, rows):
    """The packed pass reads an image's features once for all its captions and adds every step's
    gradient of the memory up once (`Memory.packed`): the gradients must be those of stepping the
    captions one by one, each with its own copy of its image's memory."""
    cfg = dataclasses.replace(CFG, attend=attend, global_context=True, position=True)
    dec = AttentionDecoder(V, D, cfg, grid=GRID).eval()
    features, tokens, lengths = _batch()
    if rows is not None:
        rows, features = torch.tensor(rows), features[:2]  # captions 0, 2, 3 of image 1; 1 of image 0
    features.requires_grad_(True)
    weights = torch.randn(int(lengths.sum()), V)  # any loss that reads every position
    out = dec(features, tokens, lengths, rows=rows)
    (out.logits * weights).sum().backward()
    packed = {n: p.grad.clone() for n, p in dec.named_parameters()}, features.grad.clone()
    dec.zero_grad()
    features.grad = None
    memory, total = dec.memory(features), 0.0
    memory = memory if rows is None else memory.select(rows)
    hidden = dec.init_hidden(memory)
    rows = {(c, t): i for i, (c, t) in enumerate(zip(out.caption.tolist(), out.step.tolist()))}
    for t in range(tokens.size(1) - 1):
        step = dec.step(tokens[:, t], hidden, memory)
        hidden = step.hidden
        for b in range(B):
            if lengths[b] > t:
                total = total + (step.logits[b] * weights[rows[b, t]]).sum()
    total.backward()
    for name, p in dec.named_parameters():
        torch.testing.assert_close(packed[0][name], p.grad, msg=name)
    torch.testing.assert_close(packed[1], features.grad)


def test_scheduled_sampling_feeds_own_predictions():
    dec = AttentionDecoder(V, D, CFG, grid=GRID).eval()
    features, tokens, lengths = _batch()
    teacher = dec(features, tokens, lengths)
    torch.manual_seed(0)
    own = dec(features, tokens, lengths, sampling_prob=1.0)
    first = teacher.step == 0
    torch.testing.assert_close(own.logits[first], teacher.logits[first])  # the first step always reads <start>
    assert not torch.allclose(own.logits[~first], teacher.logits[~first])


def test_position_embeddings_let_attention_tell_identical_regions_apart():
    """Two images whose regions are all the same vector: without position the attention must be
    uniform; with it, regions differ and the context depends on where they are."""
    features = torch.randn(1, 1, D).expand(2, L, D)
    tokens = torch.tensor([[1, 5, 2], [1, 5, 2]])
    lengths = torch.tensor([2, 2])
    flat = AttentionDecoder(V, D, dataclasses.replace(CFG, position=False)).eval()
    torch.testing.assert_close(flat(features, tokens, lengths).alphas, torch.full((4, L), 1.0 / L))
    placed = AttentionDecoder(V, D, CFG, grid=GRID).eval()
    alphas = placed(features, tokens, lengths).alphas
    assert alphas[0].std() > 0
    with pytest.raises(ValueError, match="3x3 grid"):
        placed(torch.randn(1, 16, D), tokens[:1], lengths[:1])


def test_feature_projection_happens_once_per_image():
    dec = AttentionDecoder(V, D, CFG, grid=GRID)
    memory = dec.memory(torch.randn(B, L, D))
    assert memory.features.shape == (B, L, CFG.feature_dim) and memory.keys.shape == (B, L, CFG.attention_dim)


def test_captions_sharing_an_image_equal_captions_with_copies_of_it():
    """rows: the batch's 4 captions read 2 distinct grids; the same as giving each caption its own
    copy of the grid, in outputs and in gradients (the projection runs on 2 grids instead of 4)."""
    torch.manual_seed(0)
    features, tokens, lengths = _batch()
    rows = torch.tensor([1, 0, 1, 0])
    shared = AttentionDecoder(V, D, dataclasses.replace(CFG, init_pooling="attention"), grid=GRID)
    copied = copy.deepcopy(shared)
    a = shared(features[:2], tokens, lengths, rows=rows)
    b = copied(features[rows], tokens, lengths)
    torch.testing.assert_close(a.logits, b.logits)
    caption_loss(a, tokens).total.backward()
    caption_loss(b, tokens).total.backward()
    for (name, p), q in zip(shared.named_parameters(), copied.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_trailing_padding_changes_nothing():
    dec = AttentionDecoder(V, D, CFG, grid=GRID).eval()
    features, tokens, lengths = _batch()
    longer = torch.cat([tokens, torch.zeros(B, 5, dtype=torch.long)], dim=1)  # 5 more <pad> columns
    torch.testing.assert_close(dec(features, longer, lengths).logits, dec(features, tokens, lengths).logits)


def test_attend_after_queries_with_the_word_just_read():
    """With attend "after" the first map already depends on the first word read (<start> vs another
    word); with "before" it is made from the initial state alone."""
    features = torch.randn(1, L, D).expand(2, L, D)
    tokens = torch.tensor([[1, 5, 2], [7, 5, 2]])
    lengths = torch.tensor([2, 2])
    before = AttentionDecoder(V, D, CFG, grid=GRID).eval()
    first = before(features, tokens, lengths).alphas[:2]  # step 0 of both captions
    torch.testing.assert_close(first[0], first[1])
    after = AttentionDecoder(V, D, dataclasses.replace(CFG, attend="after"), grid=GRID).eval()
    first = after(features, tokens, lengths).alphas[:2]
    assert not torch.allclose(first[0], first[1])
    assert after.init_hidden(after.memory(features)).shape == (2, CFG.hidden_dim + CFG.feature_dim)
    with pytest.raises(ConfigError, match="model.decoder.attend"):
        AttentionDecoder(V, D, dataclasses.replace(CFG, attend="later"), grid=GRID)


def test_global_context_feeds_the_grids_mean_at_every_step():
    """With global_context a step's output moves when the grid's mean moves, even with the attention's
    own context held fixed: the scene reaches the GRU at every step, not only in the initial state."""
    dec = AttentionDecoder(V, D, dataclasses.replace(CFG, global_context=True, init_pooling="none"), grid=GRID).eval()
    features, tokens, lengths = _batch()
    memory = dec.memory(features)
    state = dec.init_hidden(memory)
    moved = dataclasses.replace(memory, features=memory.features + 1.0)  # same keys: the same maps
    a, b = dec.step(tokens[:, 0], state, memory), dec.step(tokens[:, 0], state, moved)
    torch.testing.assert_close(a.alpha, b.alpha)
    assert not torch.allclose(a.hidden, b.hidden)


# --- a two-scale grid's shared channels multiplied once per 2x2 block ---------------------------


def _two_scale_grid(n: int, grid: tuple[int, int], own: int, shared: int) -> torch.Tensor:
    """(n, H'·W', own + shared): each cell's own channels, then channels the four cells of its 2x2 block
    share (what the two-scale encoder's nearest upsampling makes)."""
    H, W = grid[0] // 2, grid[1] // 2
    fine = torch.randn(n, 2 * H, 2 * W, own)
    coarse = torch.randn(n, H, W, shared).repeat_interleave(2, dim=1).repeat_interleave(2, dim=2)
    return torch.cat([fine, coarse], dim=-1).reshape(n, 4 * H * W, own + shared)


@pytest.mark.parametrize("bias", [True, False])
def test_grid_linear_is_the_plain_linear_on_a_grid_of_shared_blocks(bias):
    from captioner.model.regions import grid_linear
    features = _two_scale_grid(3, (4, 6), own=5, shared=11)  # (3, 24, 16)
    weight, b = torch.randn(7, 16), (torch.randn(7) if bias else None)
    plain = torch.nn.functional.linear
    torch.testing.assert_close(grid_linear(features, weight, b, (4, 6), 11), plain(features, weight, b))
    # it reads a block's shared channels from its first cell alone: a grid whose blocks differ is not for it
    features[:, 1, -1] += 1.0
    assert not torch.allclose(grid_linear(features, weight, b, (4, 6), 11), plain(features, weight, b))


def test_a_decoder_told_of_shared_blocks_trains_and_detects_as_one_that_is_not():
    grid, own, shared = (4, 4), 6, 10
    cfg = dataclasses.replace(CFG, attend="after", global_context=True, concepts=True)
    torch.manual_seed(0)
    plain = AttentionDecoder(V, own + shared, cfg, grid=grid)
    blocked = AttentionDecoder(V, own + shared, cfg, grid=grid, block_dim=shared)
    blocked.load_state_dict(plain.state_dict())
    features, tokens, lengths = _batch()
    features = _two_scale_grid(B, grid, own, shared)
    outs = [dec(features, tokens, lengths, detect=torch.tensor([3, 5, 8])) for dec in (plain, blocked)]
    for name in ("logits", "alphas", "concepts"):
        torch.testing.assert_close(getattr(outs[1], name), getattr(outs[0], name))
    for dec, out in zip((plain, blocked), outs):
        (out.logits.logsumexp(-1).sum() + out.concepts.sum()).backward()
    for (name, p), q in zip(plain.named_parameters(), blocked.parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    torch.testing.assert_close(blocked.word_log_probs(features), plain.word_log_probs(features))
    # a gradient by the grid (relevance maps) reaches each cell's own copy of the shared channels, as before
    grads = []
    for dec in (plain, blocked):
        x = features.clone().requires_grad_(True)
        dec.memory(x).features.sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0])


def test_shared_blocks_need_an_even_grid():
    with pytest.raises(ValueError, match="even grid"):
        AttentionDecoder(V, D, CFG, grid=GRID, block_dim=4)
    with pytest.raises(ValueError, match="block_dim"):
        AttentionDecoder(V, D, CFG, grid=(4, 4), block_dim=D)
