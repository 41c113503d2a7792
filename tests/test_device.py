import platform
import subprocess
import sys

import pytest

STEP = """
import ctypes, sys, torch
from captioner.device import keep_freed_memory

class MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = libc.mallinfo2().hblkhd
held = [torch.ones(n, 256, 256) for n in (32, 29, 25, 20, 14, 9)]  # a step's temporaries: 2.3-8 MB each
print(libc.mallinfo2().hblkhd - before)  # bytes in blocks glibc mapped for them (page-faulted in at first touch)
"""


def _mapped_bytes(mode: str) -> int:
    return int(subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True, check=True).stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt and mallinfo2 are glibc's")
def test_kept_memory_serves_a_steps_large_blocks_from_the_heap_not_fresh_mappings():
    """By default glibc maps every block larger than any freed before (from 128 KB) anew, and gives
    it back when it is freed, so the pages of each new size of a training step's temporaries are
    page-faulted in again. With `keep_freed_memory` blocks up to 32 MB come from the heap, which keeps
    them. Counted from glibc's own books (mallinfo2), not the kernel's page faults: those vary with
    what else runs (a page-fault count of this test failed twice beside the suite)."""
    size = (32 + 29 + 25 + 20 + 14 + 9) * 256 * 256 * 4  # 33.8 MB
    assert _mapped_bytes("default") >= size
    assert _mapped_bytes("keep") == 0


@pytest.mark.parametrize(("avx512_bf16", "amx", "expected"), [
    (True, True, None),  # a Xeon with AMX: bf16 trained at 0.79x float32's speed (scripts/bench_amp.py)
    (True, False, "bf16"),  # an AMD EPYC with AVX-512 BF16: 1.45x
    (False, False, None),  # no bf16 instructions: emulated
])
def test_auto_precision_on_the_cpu_is_bf16_only_where_it_trained_faster(monkeypatch, avx512_bf16, amx, expected):
    import torch

    from captioner.device import autocast_dtype

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert autocast_dtype("auto", torch.device("cpu")) is (torch.bfloat16 if expected else None)


def test_an_explicit_precision_is_honoured_on_any_cpu():
    import torch

    from captioner.device import autocast_dtype
    from captioner.errors import CaptionerError

    cpu = torch.device("cpu")
    assert autocast_dtype("off", cpu) is None
    assert autocast_dtype("bf16", cpu) is torch.bfloat16
    with pytest.raises(CaptionerError, match="fp16 needs a CUDA device"):
        autocast_dtype("fp16", cpu)


def test_seeding_takes_the_largest_seed_of_the_last_rank():
    """`train.seed` may be 2**32 - 1, and each rank seeds with seed + rank: past what NumPy takes."""
    import random

    import numpy as np
    import torch

    from captioner.device import seed_everything

    seed_everything(2**32 - 1 + 1)  # the largest train.seed, on rank 1
    drawn = random.random(), float(np.random.rand()), float(torch.rand(()))
    seed_everything(2**32)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == drawn  # seeded, reproducibly
