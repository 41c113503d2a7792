"""Where code runs: device choice, seeding, and the mixed precision the device supports."""
from __future__ import annotations

import ctypes
import ctypes.util
import random

import numpy as np
import torch

from captioner.errors import CaptionerError


def resolve_device(name: str = "auto") -> torch.device:
    """'auto' -> cuda when available, else cpu; otherwise the named device, checked to exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise CaptionerError(f"--device {name}: not a device name (try cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CaptionerError(f"--device {name}: CUDA is not available on this machine (use --device cpu)")
    return device


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices). NumPy takes seeds below 2**32 only, so it gets the
    seed modulo 2**32 (a run's `train.seed + rank` may pass it)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc's malloc.h)


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed blocks of up to 32 MB for reuse instead of returning them to
    the system. By default it maps each large block anew and unmaps it when freed, so every training
    step's temporaries (a 16x16 grid's (32, 256, 256) attention tensors, their gradients) are page-
    faulted in again at first touch: some 12,700 faults a step of the Flickr8k recipe, 15-20% of its
    time on this CPU's slow hours, nothing measurable on its fast ones (docs/RESULTS.md, Time and
    memory). The heap keeps what the largest step needed. Returns False where the C library is not
    glibc (nothing changed).
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    # 32 MB is the most glibc accepts as the threshold on 64-bit (larger blocks are still mapped)
    return bool(mallopt(_M_MMAP_THRESHOLD, 32 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def cpu_bf16_is_faster() -> bool:
    """True on a CPU where bf16 autocast trained faster than float32 (`autocast_dtype`): AVX-512 BF16
    instructions and no AMX tiles. False where torch cannot tell."""
    try:
        return torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported()
    except AttributeError:  # private helpers of torch.cpu, present since torch 2.3
        return False


def autocast_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """`train.amp` -> autocast dtype (None = float32).

    "auto": bf16 on a GPU that supports it (fp16 + GradScaler on older ones); on the CPU, bf16 where
    it has AVX-512 BF16 instructions and no AMX tiles (`cpu_bf16_is_faster`), else float32. On the
    CPU bf16 autocast runs through oneDNN, which compiles a kernel for every new shape and keeps up
    to 1,024 of them; training's shapes keep changing (caption lengths, packed steps, beams). On a
    Xeon with AMX (bf16 matrix tiles) the Flickr8k recipe trained at 0.79x (cross-entropy) and 0.90x
    (SCST) float32's speed in bf16, with 1.0 and 0.6 GiB more resident memory; on an AMD EPYC with
    AVX-512 BF16 and no AMX at 1.45x (cross-entropy, 300 steps), with 0.7 GiB more; on an AMD EPYC with
    AVX2 alone (bf16 emulated) at 0.09x (scripts/bench_amp.py). `bf16` asks for it anyway.
    """
    if amp == "off":
        return None
    if amp == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_bf16_is_faster() else None
    if amp == "bf16":
        return torch.bfloat16
    if amp == "fp16":
        if device.type != "cuda":
            raise CaptionerError("train.amp=fp16 needs a CUDA device (use bf16 or off on the CPU)")
        return torch.float16
    raise ValueError(f"train.amp={amp!r}")  # unreachable: TrainConfig allows the four values above
