"""The packed pass's per-step memories (`Memory.heads`): views of the first n rows whose backward is
one buffer, with the sums slicing step by step would make (bit for bit where the steps read the
views directly), and whose `read`s leave the features' gradient to be added up in one product."""
import torch

from captioner.model.memory import Memory

SIZES = [5, 5, 4, 2, 2, 1]  # captions still going at each step of a packed pass


def _gradients(slice_steps) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    features = torch.randn(5, 7, 3, requires_grad=True)  # (B, L, D)
    keys = torch.randn(5, 7, 4, requires_grad=True)  # (B, L, A)
    weights = [torch.randn(n, 7, 1) for n in SIZES]  # a loss that reads every step differently
    steps = slice_steps(Memory(features, keys))
    loss = sum(((m.features * w).sum() + (m.keys * w).sum() * 0.3) for m, w in zip(steps, weights))
    loss.backward()
    return features.grad, keys.grad


def test_heads_are_the_first_rows_of_every_step():
    memory = Memory(torch.randn(5, 7, 3), torch.randn(5, 7, 4))
    for n, head in zip(SIZES, memory.heads(SIZES)):
        assert torch.equal(head.features, memory.features[:n]) and torch.equal(head.keys, memory.keys[:n])
        assert head.scene is None


def test_heads_backward_is_slicing_bit_for_bit():
    """The same gradient to the last bit, not merely close: a training run's weights, and the demo's
    printed numbers, must not depend on which of the two computed it."""
    sliced = _gradients(lambda m: [Memory(m.features[:n], m.keys[:n]) for n in SIZES])
    packed = _gradients(lambda m: m.heads(SIZES))
    assert torch.equal(sliced[0], packed[0]) and torch.equal(sliced[1], packed[1])


def _read_gradients(memories) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Gradients of a loss over every step's context `read` (and its map's own term): the features',
    the keys' (read directly), and each step's map's."""
    torch.manual_seed(0)
    features = torch.randn(5, 7, 3, dtype=torch.float64, requires_grad=True)  # (B, L, D)
    keys = torch.randn(5, 7, 4, dtype=torch.float64, requires_grad=True)  # (B, L, A)
    steps = memories(Memory(features, keys))
    alphas = [torch.softmax(torch.randn(n, 7, dtype=torch.float64), -1).requires_grad_(True) for n in SIZES]
    weights = [torch.randn(n, 3, dtype=torch.float64) for n in SIZES]
    loss = sum((m.read(a) * w).sum() + (m.features * w[:, None]).sum() * 0.5 + m.keys.sum() * 0.3
               for m, a, w in zip(steps, alphas, weights))
    loss.backward()
    return features.grad, keys.grad, [a.grad for a in alphas]


def test_read_is_the_map_weighted_sum_of_the_regions():
    memory = Memory(torch.randn(5, 7, 3), torch.randn(5, 7, 4))
    alpha = torch.softmax(torch.randn(5, 7), -1)
    expected = (alpha.unsqueeze(-1) * memory.features).sum(1)  # (B, D)
    torch.testing.assert_close(memory.read(alpha), expected)
    for n, head in zip(SIZES, memory.heads(SIZES)):
        torch.testing.assert_close(head.read(alpha[:n]), expected[:n])


def test_heads_add_up_the_reads_gradient_once_as_slicing_would():
    """The steps' reads leave their share of the features' gradient for `_Heads` to add up in one
    product; with the features also read directly (the mean, the detector), all of it must arrive,
    and each map's gradient as step by step."""
    sliced = _read_gradients(lambda m: [Memory(m.features[:n], m.keys[:n]) for n in SIZES])
    packed = _read_gradients(lambda m: m.heads(SIZES))
    torch.testing.assert_close(packed[0], sliced[0])
    torch.testing.assert_close(packed[1], sliced[1])
    for p, s in zip(packed[2], sliced[2]):
        torch.testing.assert_close(p, s)


def test_a_read_of_features_without_gradient_keeps_nothing():
    memory = Memory(torch.randn(5, 7, 3), torch.randn(5, 7, 4))  # features need no gradient
    steps = memory.heads(SIZES)
    alpha = torch.softmax(torch.randn(5, 7), -1).requires_grad_(True)
    steps[0].read(alpha).sum().backward()
    assert alpha.grad is not None and steps[0].reads == []
