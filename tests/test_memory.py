"""The packed pass's per-step memories (`Memory.packed`): each step's captions' keys and scene, and
contexts read per image (an image's captions share its features), with the gradients that selecting
each caption's memory and slicing step by step would give."""
import pytest
import torch

from captioner.model.memory import Memory, _slots

SIZES = [6, 6, 5, 3, 3, 1]  # captions still going at each step of a packed pass
ROWS = torch.tensor([2, 0, 2, 1, 0, 2])  # the image of each caption: image 2 has three, image 1 one


def _memory(dtype=torch.float32, requires_grad=False) -> Memory:
    torch.manual_seed(0)
    features = torch.randn(3, 7, 5, dtype=dtype, requires_grad=requires_grad)  # (N, L, D)
    keys = torch.randn(3, 7, 4, dtype=dtype, requires_grad=requires_grad)  # (N, L, A)
    return Memory(features, keys)


def test_slots_rank_each_caption_among_its_images():
    assert _slots(ROWS).tolist() == [0, 0, 1, 0, 1, 2]
    assert _slots(torch.tensor([4, 3, 2])).tolist() == [0, 0, 0]


def test_packed_steps_hold_their_captions_memories():
    memory = _memory()
    alpha = torch.softmax(torch.randn(6, 7), -1)  # (B, L)
    per_caption = memory.select(ROWS)  # (B, L, D), (B, L, A)
    for n, step in zip(SIZES, memory.packed(ROWS, SIZES)):
        assert torch.equal(step.keys, per_caption.keys[:n])
        torch.testing.assert_close(step.mean(), per_caption.features[:n].mean(1))
        torch.testing.assert_close(step.read(alpha[:n]), (alpha[:n, :, None] * per_caption.features[:n]).sum(1))


def _gradients(steps_of) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Gradients of a loss over every step's context, keys and scene (and the features read
    directly, as the initial state does): the features', the keys', each step's map's."""
    memory = _memory(torch.float64, requires_grad=True)
    steps = steps_of(memory)
    torch.manual_seed(1)
    alphas = [torch.softmax(torch.randn(n, 7, dtype=torch.float64), -1).requires_grad_(True) for n in SIZES]
    weights = [torch.randn(n, 5, dtype=torch.float64) for n in SIZES]
    loss = memory.features.sum() * 0.1 + sum(
        (m.read(a) * w).sum() + (m.mean() * w).sum() * 0.5 + (m.keys.sum(1) * w[:, :4]).sum() * 0.3
        for m, a, w in zip(steps, alphas, weights))
    loss.backward()
    return memory.features.grad, memory.keys.grad, [a.grad for a in alphas]


def test_packed_gradients_are_those_of_reading_each_captions_own_copy():
    """The reads' share of the features' gradient is added up once per pass, per image: it must
    be what each caption's own copy of its image's memory, sliced step by step, would get."""
    def sliced(m):
        per_caption = m.select(ROWS)
        return [Memory(per_caption.features[:n], per_caption.keys[:n]) for n in SIZES]

    expected, packed = _gradients(sliced), _gradients(lambda m: m.packed(ROWS, SIZES))
    torch.testing.assert_close(packed[0], expected[0])
    torch.testing.assert_close(packed[1], expected[1])
    for p, e in zip(packed[2], expected[2]):
        torch.testing.assert_close(p, e)


@pytest.mark.parametrize("needs_grad", [False, True])
def test_reads_are_kept_only_for_features_that_need_a_gradient(needs_grad):
    memory = _memory()
    features = memory.features.requires_grad_(needs_grad)
    steps = memory.packed(ROWS, SIZES)
    alpha = torch.softmax(torch.randn(6, 7), -1).requires_grad_(True)
    context = steps[0].read(alpha)
    assert steps[0].reads == []
    context.sum().backward()
    assert alpha.grad is not None and steps[0].reads == []  # used up by the features' node, or never kept
    assert (features.grad is not None) == needs_grad


def test_an_expanded_memory_serves_each_row_as_its_own_copy_would():
    """`expand(k)`: an image's k beams read its one memory; every row's context, mean and attention
    must be what a per-row copy gives, and selecting rows or whole images from it too."""
    memory, k = _memory(), 3
    memory = Memory(memory.features, memory.keys, memory.features.mean(1) + 1.0)  # a scene of its own
    rows = torch.arange(3).repeat_interleave(k)  # (9,) image of each row: 0,0,0,1,1,1,2,2,2
    shared, copied = memory.expand(k), memory.select(rows)
    assert shared.features.shape == (3, 7, 5) and copied.features.shape == (9, 7, 5)
    alpha = torch.softmax(torch.randn(9, 7), -1)
    torch.testing.assert_close(shared.read(alpha), copied.read(alpha))
    torch.testing.assert_close(shared.mean(), copied.mean())
    picked = torch.tensor([7, 1, 1])
    assert torch.equal(shared.select(picked).features, copied.select(picked).features)
    images = torch.tensor([2, 0])
    kept = shared.select_images(images, k)  # the search drops done images, their k rows each
    assert kept.shared == k and torch.equal(kept.features, memory.features[images])
    kept_rows = torch.tensor([6, 7, 8, 0, 1, 2])
    torch.testing.assert_close(kept.read(alpha[kept_rows]), copied.read(alpha)[kept_rows])
    torch.testing.assert_close(kept.mean(), copied.mean()[kept_rows])
    assert torch.equal(copied.select_images(images, k).features, copied.features[kept_rows])  # rows copied
