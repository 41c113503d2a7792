"""The packed pass's per-step memories (`Memory.heads`): views of the first n rows whose backward is
one buffer, with the sums slicing step by step would make, bit for bit."""
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
