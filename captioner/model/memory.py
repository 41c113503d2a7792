"""What the decoder attends to: an image's memory, computed once and constant while decoding.

Shapes: B images (or captions, or beams), L regions, D feature width, A attention width;
in a packed pass N images, C = the most captions of one image, n_t captions still going at step t.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor


@dataclass(frozen=True)
class Memory:
    """What the decoder attends to, computed once per image and constant while decoding.

    features: (B, L, D); keys: (B, L, A) = 2·W1·features (`BahdanauAttention.keys`); scene: (B, D)
    the grid's mean, when the decoder reads it (`global_context`); None = computed from `features`
    where needed.
    shared: S, the consecutive rows that read each of these memories (`expand`: an image's beams):
    the memory serves B·S rows, row r reading memory r // S, and no row has a copy of its own.
    """

    features: Tensor
    keys: Tensor
    scene: Tensor | None = None
    shared: int = 1

    def expand(self, k: int) -> Memory:
        """Each row's memory for k consecutive rows (an image's beams, its drawn captions), shared:
        k times the rows, nothing copied (a beam search's (B·K, L, D) copy was 84 MB at batch 32)."""
        return replace(self, shared=self.shared * k)

    def select(self, rows: Tensor) -> Memory:
        """The memories of rows `rows` (R,) int64, in that order: (B·S rows) -> (R rows), each with its
        own copy. One row may be selected many times (a caption's image in teacher forcing)."""
        images = rows // self.shared  # (R,)
        scene = None if self.scene is None else self.scene.index_select(0, images)
        return Memory(self.features.index_select(0, images), self.keys.index_select(0, images), scene)

    def select_images(self, images: Tensor, k: int) -> Memory:
        """The rows of the images `images` (n,) int64 of a memory expanded k rows per image (`expand`):
        their k rows each, still shared where they were."""
        if self.shared == k:
            scene = None if self.scene is None else self.scene.index_select(0, images)
            return replace(self, features=self.features.index_select(0, images),
                           keys=self.keys.index_select(0, images), scene=scene)
        return self.select((images.unsqueeze(1) * k + torch.arange(k, device=images.device)).view(-1))  # (n·k,)

    def packed(self, rows: Tensor, sizes: list[int]) -> list[PackedMemory]:
        """The memories of a packed pass's steps: per step t, those of the captions still going.

        Args:
            rows: (B,) int64 the image (row of this memory) of each caption, captions sorted so that
                the n_t going at step t are the first n_t.
            sizes: n_t per step, non-increasing.
        Returns:
            per step, a `PackedMemory` with keys (n_t, L, A) and scene (n_t, D) of its captions, which
            reads their contexts from the images' features (N, L, D): an image's captions share its
            features, never copied per caption.
        """
        slot = _slots(rows)  # (B,) the caption's rank among its image's captions
        captions_per_image = int(slot.max()) + 1
        cell = rows * captions_per_image + slot  # (B,) its row of an (N·C) grid, by image then rank
        reads: list[tuple[Tensor, Tensor]] = []
        features = _AddReads.apply(self.features, reads)  # (N, L, D), its gradient from every read
        keys = _Heads.apply(self.keys.index_select(0, rows), sizes)  # (n_t, L, A) per step
        scene = _Heads.apply(self.mean().index_select(0, rows), sizes)  # (n_t, D) per step
        return [PackedMemory(keys[t], scene[t], features, cell[:n], captions_per_image, reads)
                for t, n in enumerate(sizes)]

    def read(self, alpha: Tensor) -> Tensor:
        """The contexts: the regions weighted by each row's map, (B·S, L) -> (B·S, D) in the features'
        dtype; the S rows of a shared memory read it together."""
        B, L, D = self.features.shape
        weights = alpha.to(self.features.dtype).view(B, self.shared, L)  # (B, S, L)
        return torch.bmm(weights, self.features).view(-1, D)  # (B, S, L) @ (B, L, D) -> (B·S, D)

    def mean(self) -> Tensor:
        """(B·S, D) the grid's mean of each row's memory."""
        mean = self.features.mean(dim=1) if self.scene is None else self.scene  # (B, D)
        return mean if self.shared == 1 else mean.repeat_interleave(self.shared, dim=0)


@dataclass(frozen=True)
class PackedMemory:
    """One step of a packed pass (`Memory.packed`): keys (n, L, A) and scene (n, D) of the n captions
    still going, and the features (N, L, D) of the batch's images, caption i's being row cell[i] // C.

    An image's captions read its features together, as one (C, L) @ (L, D) product per image: the
    features are read once per step, not once per caption (a (32, 256, 512) copy and 5x the memory
    traffic on the recipe's batches of 32 captions, 5 per image). The features' gradient from every
    step's read is added up once, after the last (`_AddReads`).
    """

    keys: Tensor
    scene: Tensor
    features: Tensor
    cell: Tensor
    captions_per_image: int
    reads: list[tuple[Tensor, Tensor]]

    def read(self, alpha: Tensor) -> Tensor:
        """The contexts of the step's captions, (n, L) -> (n, D) in the features' dtype."""
        return _Read.apply(alpha.to(self.features.dtype), self.features, self.cell, self.captions_per_image,
                           self.reads)

    def mean(self) -> Tensor:
        """(n, D) the grid's mean of each caption's image."""
        return self.scene


def _slots(rows: Tensor) -> Tensor:
    """(B,) int64 images -> (B,) the rank of each entry among the entries of its image, in order."""
    order = torch.argsort(rows, stable=True)  # (B,) by image, each image's in order
    ranked = rows[order]  # (B,) sorted
    first = torch.searchsorted(ranked, ranked)  # (B,) where each image's run starts
    slot = torch.empty_like(rows)
    slot[order] = torch.arange(len(rows), device=rows.device) - first
    return slot


class _Heads(torch.autograd.Function):
    """x[:n] for every n of a non-increasing `sizes`, as one autograd node.

    Sliced step by step, each slice's backward pads its gradient to x's full size (a zero fill of
    the whole (B, L, A) per step, then an add). Here the steps' gradients are added into one
    buffer, filled once, last step first: the order autograd delivers them in, so the sums are bit
    for bit those of slicing.
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


class _Read(torch.autograd.Function):
    """contexts = alpha · features of one step of a packed pass, per image: the maps (n, L) laid out
    as (N, C, L) by each caption's `cell`, (N, C, L) @ (N, L, D) -> (N, C, D), each caption's row
    picked out -> (n, D).

    The features' gradient, sum over steps of mapᵀ · dcontext, is left in `reads` as the step's
    ((N, C, L), (N, C, D)) for `_AddReads` to add up in one product; step by step it would be T
    products each writing the whole (N, L, D).
    """

    @staticmethod
    def forward(ctx, alpha: Tensor, features: Tensor, cell: Tensor, captions_per_image: int,
                reads: list[tuple[Tensor, Tensor]]) -> Tensor:
        N, L, D = features.shape
        maps = alpha.new_zeros(N * captions_per_image, L).index_copy_(0, cell, alpha)  # (N·C, L)
        maps = maps.view(N, captions_per_image, L)  # (N, C, L), zero where no caption of the image goes
        ctx.save_for_backward(maps, features, cell)
        ctx.reads = reads
        contexts = torch.bmm(maps, features)  # (N, C, L) @ (N, L, D) -> (N, C, D)
        return contexts.view(-1, D).index_select(0, cell)  # (n, D)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        maps, features, cell = ctx.saved_tensors
        N, C, L = maps.shape
        grads = grad.new_zeros(N * C, grad.size(-1)).index_copy_(0, cell, grad).view(N, C, -1)  # (N, C, D)
        if ctx.needs_input_grad[1]:
            ctx.reads.append((maps, grads))
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        dalpha = torch.bmm(grads, features.transpose(1, 2))  # (N, C, D) @ (N, D, L) -> (N, C, L)
        return dalpha.view(N * C, L).index_select(0, cell), None, None, None, None  # (n, L)


class _AddReads(torch.autograd.Function):
    """The features (N, L, D) as the packed pass's reads see them: their gradient is what every
    step's `_Read` left, sum_t maps_tᵀ · dcontexts_t = (N, L, C·T) @ (N, C·T, D), one product.
    Autograd runs this node after every step that read it, so `reads` is complete by then."""

    @staticmethod
    def forward(ctx, features: Tensor, reads: list[tuple[Tensor, Tensor]]) -> Tensor:
        ctx.reads = reads
        ctx.set_materialize_grads(False)
        return features.view_as(features)

    @staticmethod
    def backward(ctx, grad: Tensor | None) -> tuple[Tensor | None, None]:
        if ctx.reads:
            maps = torch.cat([m for m, _ in ctx.reads], dim=1)  # (N, C·T, L)
            grads = torch.cat([g for _, g in ctx.reads], dim=1)  # (N, C·T, D)
            ctx.reads.clear()
            read = torch.bmm(maps.transpose(1, 2), grads)  # (N, L, C·T) @ (N, C·T, D) -> (N, L, D)
            grad = read if grad is None else grad + read
        return grad, None
