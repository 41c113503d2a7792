"""What the decoder attends to: an image's memory, computed once and constant while decoding.

Shapes: B images (or captions, or beams), L regions, D feature width, A attention width.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class Memory:
    """What the decoder attends to, computed once per image and constant while decoding.

    features: (B, L, D); keys: (B, L, A) = W1·features; scene: (B, D) the grid's mean, when the
    decoder reads it (`global_context`); None = computed from `features` where needed.
    reads: set on the steps of a packed pass (`heads`): where `read` leaves the features' share of
    its gradient, for the pass to add up once (`_Heads`).
    """

    features: Tensor
    keys: Tensor
    scene: Tensor | None = None
    reads: list[tuple[Tensor, Tensor]] | None = field(default=None, repr=False, compare=False)

    def select(self, rows: Tensor) -> Memory:
        """The memories of rows `rows` (R,) int64, in that order: (B, ...) -> (R, ...). One row may
        be selected many times (an image's captions in a training batch, its beams in a search)."""
        scene = None if self.scene is None else self.scene.index_select(0, rows)
        return Memory(self.features.index_select(0, rows), self.keys.index_select(0, rows), scene)

    def heads(self, sizes: list[int]) -> list[Memory]:
        """The first n rows for every n of `sizes` (non-increasing): the memories of the captions
        still going at each step of a packed pass. One autograd node per tensor for all the steps
        (`_Heads`), which also adds up the gradient every step's `read` leaves for the features."""
        reads: list[tuple[Tensor, Tensor]] = []
        features = _Heads.apply(self.features, sizes, reads)  # one (n_t, L, D) view per step
        keys = _Heads.apply(self.keys, sizes, None)  # (n_t, L, A) per step
        scene = None if self.scene is None else _Heads.apply(self.scene, sizes, None)  # (n_t, D) per step
        return [Memory(features[t], keys[t], None if scene is None else scene[t], reads) for t in range(len(sizes))]

    def read(self, alpha: Tensor) -> Tensor:
        """The context: the regions weighted by a map, (B, L) -> (B, D) in the features' dtype."""
        weights = alpha.to(self.features.dtype)
        if self.reads is not None:
            return _Read.apply(weights, self.features, self.reads)
        return torch.bmm(weights.unsqueeze(1), self.features).squeeze(1)  # (B, 1, L) @ (B, L, D) -> (B, D)

    def mean(self) -> Tensor:
        """(B, D) the grid's mean."""
        return self.features.mean(dim=1) if self.scene is None else self.scene


class _Heads(torch.autograd.Function):
    """x[:n] for every n of a non-increasing `sizes`, as one autograd node.

    Sliced step by step, each slice's backward pads its gradient to x's full size (a zero fill of
    the whole (B, L, D) memory per step, then an add): 40% of a training step on a 16x16 grid. Here
    the steps' gradients are added into one buffer, filled once, last step first: the order autograd
    delivers them in, so the sums are bit for bit those of slicing.

    With `reads` (the features' heads), the steps' `_Read`s leave (alpha_t, dcontext_t) there instead
    of a gradient, and the features' gradient from all of them is one batched product,
    sum_t alpha_tᵀ · dcontext_t = (B, L, T) @ (B, T, D). Step by step that is T outer products
    (K = 1 matmuls, each writing the whole (n_t, L, D)): on a 16x16 grid 47% of a profiled training
    step, whose steps this made 1.07x faster with `keep_freed_memory` (1.22x without; docs/BENCHMARKS.md).
    Autograd runs this node after every step that read a view, so `reads` is complete by then.
    """

    @staticmethod
    def forward(ctx, x: Tensor, sizes: list[int], reads: list[tuple[Tensor, Tensor]] | None) -> tuple[Tensor, ...]:
        ctx.sizes, ctx.shape, ctx.reads = sizes, x.shape, reads
        ctx.set_materialize_grads(False)  # a step whose view got no gradient gives None, not zeros
        return tuple(x[:n] for n in sizes)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, None, None]:
        total = None
        for n, grad in reversed(list(zip(ctx.sizes, grads))):
            if grad is not None:
                total = grad.new_zeros(ctx.shape) if total is None else total
                total[:n] += grad
        if ctx.reads:
            B, L, D = ctx.shape
            first_alpha, first_grad = ctx.reads[0]
            alphas = first_alpha.new_zeros(B, len(ctx.reads), L)  # (B, T, L), zero where a caption had ended
            grads_ = first_grad.new_zeros(B, len(ctx.reads), D)  # (B, T, D)
            for t, (alpha, grad) in enumerate(ctx.reads):
                alphas[: len(alpha), t] = alpha
                grads_[: len(grad), t] = grad
            ctx.reads.clear()
            read = torch.bmm(alphas.transpose(1, 2), grads_)  # (B, L, T) @ (B, T, D) -> (B, L, D)
            total = read if total is None else total + read
        return total, None, None


class _Read(torch.autograd.Function):
    """context = alpha · features of one step of a packed pass, (n, L), (n, L, D) -> (n, D), whose
    features' gradient is left in `reads` for `_Heads` to add up with the other steps'."""

    @staticmethod
    def forward(ctx, alpha: Tensor, features: Tensor, reads: list[tuple[Tensor, Tensor]]) -> Tensor:
        ctx.save_for_backward(alpha, features)
        ctx.reads = reads
        return torch.bmm(alpha.unsqueeze(1), features).squeeze(1)  # (n, 1, L) @ (n, L, D) -> (n, D)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None]:
        alpha, features = ctx.saved_tensors
        if ctx.needs_input_grad[1]:
            ctx.reads.append((alpha, grad))
        if not ctx.needs_input_grad[0]:
            return None, None, None
        return torch.bmm(features, grad.unsqueeze(-1)).squeeze(-1), None, None  # (n, L, D) @ (n, D, 1) -> (n, L)
