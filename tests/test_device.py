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


def test_auto_precision_trains_in_float32_on_the_cpu_and_honours_an_explicit_choice():
    """bf16 autocast on the CPU compiles a oneDNN kernel for every new shape: on the Flickr8k recipe it
    trained at 0.79x float32's speed with a GiB more memory (scripts/bench_amp.py), so `auto` must not
    pick it there, even on CPUs with bf16 instructions."""
    import torch

    from captioner.device import autocast_dtype
    from captioner.errors import CaptionerError

    cpu = torch.device("cpu")
    assert autocast_dtype("auto", cpu) is None
    assert autocast_dtype("off", cpu) is None
    assert autocast_dtype("bf16", cpu) is torch.bfloat16
    with pytest.raises(CaptionerError, match="fp16 needs a CUDA device"):
        autocast_dtype("fp16", cpu)
