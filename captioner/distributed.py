"""Several processes under `torchrun`, and the reproducible randomness that makes resuming exact.

`torchrun --nproc_per_node=N` starts N copies of the same command with RANK, WORLD_SIZE and
LOCAL_RANK in the environment; `init_distributed` joins them (gloo on the CPU, nccl on GPUs).
Without those variables everything here is a no-op for one process.

The training order is a pure function of (seed, epoch, rank, world size, batch size): a
permutation of the captions drawn from (seed, epoch), optionally keeping each image's captions
together, cut into global batches of `batch_size * world_size` that are shared out to the ranks. Nothing
about the order lives in a sampler's hidden state, so a run resumed at (epoch, batch) continues
on the very batch it stopped at, and the ranks together see every caption exactly once per epoch.
The RNG states (`capture_rng` / `restore_rng`) are plain tensors and ints, so checkpoints holding
them load with `weights_only=True`; `SeededItems` makes random augmentation a function of the item.
"""
from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Sampler

from captioner.errors import CaptionerError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands among the ones `torchrun` started (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes checkpoints, logs and metrics; the others only compute."""
        return self.rank == 0


def dist_from_env() -> DistInfo:
    """Read RANK / WORLD_SIZE / LOCAL_RANK as set by torchrun (defaults: one process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    if not 0 <= rank < world:
        raise CaptionerError(f"RANK={rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
    return DistInfo(rank, world, local)


def init_distributed(info: DistInfo, device: torch.device) -> torch.device:
    """Join the process group when there are several processes; returns this process's device
    (on GPUs, `cuda:LOCAL_RANK`)."""
    if not info.enabled:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        # Long timeout: rank 0 may fill the feature cache (hours for COCO) while the others wait.
        dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, timeout=timedelta(hours=6))
        log.debug("rank %d/%d joined the %s process group", info.rank, info.world_size, backend)
    return device


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if _active():
        dist.barrier()


@contextlib.contextmanager
def main_first() -> Iterator[None]:
    """Rank 0 runs the block first (it may write files: the shapes set, the feature cache); the
    other ranks run it once rank 0 is done, and find the files ready."""
    if _active() and dist.get_rank() != 0:
        dist.barrier()
    yield
    if _active() and dist.get_rank() == 0:
        dist.barrier()


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (a one-element list for one process)."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` on every rank."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum over the ranks of a few floats (float64 on the CPU: gloo and nccl agree)."""
    if not _active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return t.cpu().tolist()


# --- the data order --------------------------------------------------------------------------


def mix_seed(*values: int) -> int:
    """One generator seed from several integers (run seed, epoch, item, ...)."""
    out = 0
    for v in values:
        out = (out * 1_000_003 + v) % (2**63)
    return out


def epoch_batches(
    n: int, batch_size: int, seed: int, epoch: int, rank: int = 0, world_size: int = 1, shuffle: bool = True,
    groups: Sequence[int] | None = None,
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
    """
    if n < world_size:
        raise CaptionerError(f"{n} training captions are too few for {world_size} processes")
    g = torch.Generator().manual_seed(mix_seed(seed, epoch))
    if not shuffle:
        order = list(range(n))
    elif groups is None:
        order = torch.randperm(n, generator=g).tolist()
    else:
        members: dict[int, list[int]] = {}
        for item, group in enumerate(groups):
            members.setdefault(group, []).append(item)
        keys = list(members)
        order = [i for k in torch.randperm(len(keys), generator=g).tolist() for i in members[keys[k]]]
    per_step = batch_size * world_size
    chunks = [order[i : i + per_step] for i in range(0, n, per_step)]
    if len(chunks) > 1 and len(chunks[-1]) < world_size:
        last = chunks.pop()
        chunks[-1] = chunks[-1] + last
    return [_share(chunk, rank, world_size) for chunk in chunks]


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
                 shuffle: bool = True, groups: Sequence[int] | None = None) -> None:
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.rank, self.world_size, self.shuffle, self.groups = rank, world_size, shuffle, groups
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __iter__(self) -> Iterator[list[int]]:
        batches = epoch_batches(self.n, self.batch_size, self.seed, self.epoch, self.rank, self.world_size,
                                self.shuffle, self.groups)
        yield from batches[self.start_batch:]

    def __len__(self) -> int:
        return max(0, steps_per_epoch(self.n, self.batch_size, self.world_size) - self.start_batch)


# --- RNG state (plain tensors and ints: checkpoints load with weights_only=True) -------------


def capture_rng() -> dict[str, Any]:
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": [py_version, torch.tensor(py_state, dtype=torch.int64), py_gauss],
        "numpy": [np_name, torch.from_numpy(np_keys.astype(np.int64)), int(np_pos), int(np_has_gauss),
                  float(np_gauss)],
    }


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state.tolist()), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


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
