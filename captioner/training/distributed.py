"""Several processes under `torchrun`, and the RNG states that make resuming exact.

`torchrun --nproc_per_node=N` starts N copies of the same command with RANK, WORLD_SIZE and
LOCAL_RANK in the environment; `init_distributed` joins them (gloo on the CPU, nccl on GPUs).
Without those variables everything here is a no-op for one process. The RNG states
(`capture_rng` / `restore_rng`) are plain tensors and ints, so checkpoints holding them load with
`weights_only=True`. The data order each rank trains on is `captioner.data.order`'s.
"""
from __future__ import annotations

import contextlib
import logging
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

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


def max_over_ranks(value: float) -> float:
    """The largest of every rank's `value` (the value itself for one process)."""
    if not _active():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum over the ranks of a few floats (float64 on the CPU: gloo and nccl agree)."""
    if not _active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return t.cpu().tolist()


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
