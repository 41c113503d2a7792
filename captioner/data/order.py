"""The training order, a pure function of (seed, epoch, rank, world size, batch size).

A permutation of the captions drawn from (seed, epoch), optionally keeping each image's captions
together, is cut into global batches of `batch_size * world_size` that are shared out to the
ranks. Nothing about the order lives in a sampler's hidden state, so a run resumed at (epoch,
batch) continues on the very batch it stopped at, and the ranks together see every caption exactly
once per epoch. `SeededItems` makes random augmentation a function of the item.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from captioner.errors import CaptionerError


def mix_seed(*values: int) -> int:
    """One generator seed from several integers (run seed, epoch, item, ...)."""
    out = 0
    for v in values:
        out = (out * 1_000_003 + v) % (2**63)
    return out


def epoch_batches(
    n: int, batch_size: int, seed: int, epoch: int, rank: int = 0, world_size: int = 1, shuffle: bool = True,
    groups: Sequence[int] | None = None, lengths: Sequence[int] | None = None, pool: int = 50,
) -> list[list[int]]:
    """This rank's batches (lists of item indices) for `epoch`.

    A permutation of range(n) from (seed, epoch) is cut into global batches of
    `batch_size * world_size`; each global batch is cut into `world_size` contiguous shares, one
    per rank. A last global batch too small to give every rank an item is merged into the one
    before, so every rank takes the same number of steps (DDP needs that) and no item is dropped
    or repeated.

    With `groups` (the group of each item: its image), the permutation is of the groups, and each
    group's items follow one another: the five captions of an image land in one batch (and one
    rank), which then encodes or projects that image once for all of them (`seq_per_img` in
    neuraltalk2 and its descendants).

    With `lengths` (each item's length), the shuffled order is cut into pools of `pool` global
    batches and each pool sorted longest first (by a group's longest item), so a batch holds
    captions of similar lengths and the decoder runs fewer steps on it (`group_by_length` of
    Hugging Face's Trainer, which sorts "megabatches" of 50 batches the same way). The pools stay in
    their random order, so an epoch is still a fresh mix.
    """
    if n < world_size:
        raise CaptionerError(f"{n} training captions are too few for {world_size} processes")
    g = torch.Generator().manual_seed(mix_seed(seed, epoch))
    if not shuffle:
        units = [[i] for i in range(n)]
    elif groups is None:
        units = [[i] for i in torch.randperm(n, generator=g).tolist()]
    else:
        members: dict[int, list[int]] = {}
        for item, group in enumerate(groups):
            members.setdefault(group, []).append(item)
        keys = list(members)
        units = [members[keys[k]] for k in torch.randperm(len(keys), generator=g).tolist()]
    per_step = batch_size * world_size
    if lengths is not None:
        units = _sorted_in_pools(units, lengths, pool * per_step)
    order = [i for unit in units for i in unit]
    chunks = [order[i : i + per_step] for i in range(0, n, per_step)]
    if len(chunks) > 1 and len(chunks[-1]) < world_size:
        last = chunks.pop()
        chunks[-1] = chunks[-1] + last
    return [_share(chunk, rank, world_size) for chunk in chunks]


def _sorted_in_pools(units: list[list[int]], lengths: Sequence[int], pool_size: int) -> list[list[int]]:
    """`units` (an item, or a group's items) cut into pools of about `pool_size` items, each pool
    sorted by its units' longest item, longest first (a stable sort: ties keep their shuffled order)."""
    out: list[list[int]] = []
    start = 0
    while start < len(units):
        end, size = start, 0
        while end < len(units) and size < pool_size:
            size += len(units[end])
            end += 1
        out.extend(sorted(units[start:end], key=lambda u: -max(lengths[i] for i in u)))
        start = end
    return out


def _share(chunk: list[int], rank: int, world_size: int) -> list[int]:
    """Rank `rank`'s contiguous share of a global batch (sizes differ by at most one)."""
    size, extra = divmod(len(chunk), world_size)
    start = rank * size + min(rank, extra)
    return chunk[start : start + size + (rank < extra)]


def steps_per_epoch(n: int, batch_size: int, world_size: int = 1) -> int:
    """Optimizer steps in one epoch of `n` items (the same on every rank)."""
    per_step = batch_size * world_size
    steps = -(-n // per_step)
    if steps > 1 and n - (steps - 1) * per_step < world_size:
        steps -= 1
    return steps


class EpochBatchSampler(Sampler[list[int]]):
    """Yields this rank's batches of one epoch from `start_batch` on (see `epoch_batches`).

    Call `set_epoch(epoch, start_batch)` before each epoch; a resumed run passes the number of
    batches the interrupted run had already consumed.
    """

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, groups: Sequence[int] | None = None,
                 lengths: Sequence[int] | None = None) -> None:
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.rank, self.world_size, self.shuffle, self.groups = rank, world_size, shuffle, groups
        self.lengths = lengths
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __iter__(self) -> Iterator[list[int]]:
        batches = epoch_batches(self.n, self.batch_size, self.seed, self.epoch, self.rank, self.world_size,
                                self.shuffle, self.groups, self.lengths)
        yield from batches[self.start_batch:]

    def __len__(self) -> int:
        return max(0, steps_per_epoch(self.n, self.batch_size, self.world_size) - self.start_batch)



class SeededItems(Dataset):
    """`dataset[i]` with the torch RNG seeded from (seed, epoch, i): random augmentation depends on
    the item alone, not on the worker or on how many batches came before (a resumed run gets the
    same crops as an uninterrupted one). The caller's RNG is left untouched."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> Any:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(mix_seed(self.seed, self.epoch, i))
            return self.dataset[i]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """A batch through the dataset's own `__getitems__` when it has one (which may share one
        augmented image between items), seeded from (seed, epoch, first index): the batches of an
        epoch are fixed by the sampler, so a resumed run still gets the same augmentation."""
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is None:
            return [self[i] for i in indices]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(mix_seed(self.seed, self.epoch, indices[0]))
            return getitems(indices)
