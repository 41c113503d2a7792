"""What the decoder attends to: an image's memory, computed once and constant while decoding.

Shapes: B images (or captions, or beams), L regions, D feature width, A attention width.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Memory:
    """What the decoder attends to, computed once per image and constant while decoding.

    features: (B, L, D); keys: (B, L, A) = W1·features; scene: (B, D) the grid's mean, when the
    decoder reads it (`global_context`); None = computed from `features` where needed.
    """

    features: Tensor
    keys: Tensor
    scene: Tensor | None = None

    def select(self, rows: Tensor) -> Memory:
        """The memories of rows `rows` (R,) int64, in that order: (B, ...) -> (R, ...). One row may
        be selected many times (an image's captions in a training batch, its beams in a search)."""
        scene = None if self.scene is None else self.scene.index_select(0, rows)
        return Memory(self.features.index_select(0, rows), self.keys.index_select(0, rows), scene)

    def heads(self, sizes: list[int]) -> list[Memory]:
        """The first n rows for every n of `sizes` (non-increasing): the memories of the captions
        still going at each step of a packed pass. One autograd node for all of them (`_Heads`)."""
        parts = [t for t in (self.features, self.keys, self.scene) if t is not None]
        views = [_Heads.apply(t, sizes) for t in parts]  # per tensor: one view per step
        return [Memory(*(v[t] for v in views)) for t in range(len(sizes))]

    def mean(self) -> Tensor:
        """(B, D) the grid's mean."""
        return self.features.mean(dim=1) if self.scene is None else self.scene


class _Heads(torch.autograd.Function):
    """x[:n] for every n of a non-increasing `sizes`, as one autograd node.

    Sliced step by step, each slice's backward pads its gradient to x's full size (a zero fill of
    the whole (B, L, D) memory per step, then an add): 40% of a training step on a 16x16 grid. Here
    the steps' gradients are added into one buffer, filled once, last step first: the order autograd
    delivers them in, so the sums, and the trained weights, are bit for bit those of slicing.
    """

    @staticmethod
    def forward(ctx, x: Tensor, sizes: list[int]) -> tuple[Tensor, ...]:
        ctx.sizes, ctx.shape = sizes, x.shape
        ctx.set_materialize_grads(False)  # a step whose view got no gradient gives None, not zeros
        return tuple(x[:n] for n in sizes)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, None]:
        total = None
        for n, grad in reversed(list(zip(ctx.sizes, grads))):
            if grad is not None:
                total = grad.new_zeros(ctx.shape) if total is None else total
                total[:n] += grad
        return total, None
