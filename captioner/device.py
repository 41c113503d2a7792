"""Where code runs: device choice, seeding, and the mixed precision the device supports."""
from __future__ import annotations

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
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def cpu_has_native_bf16() -> bool:
    """True on CPUs with bf16 matrix instructions (AVX512-BF16 or AMX), where bf16 autocast pays off."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


def autocast_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """`train.amp` -> autocast dtype (None = float32).

    "auto": bf16 on a GPU that supports it (fp16 + GradScaler on older ones). On the CPU, bf16 where
    the CPU has native bf16 instructions: there the default-size decoder's steps measured 1.5x faster
    than float32 (AVX512-BF16, scripts/bench_train.py --amp); float32 elsewhere. Very small decoders
    gain nothing (configs/shapes.yaml turns it off).
    """
    if amp == "off":
        return None
    if amp == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if device.type == "cpu" and cpu_has_native_bf16() else None
    if amp == "bf16":
        return torch.bfloat16
    if amp == "fp16":
        if device.type != "cuda":
            raise CaptionerError("train.amp=fp16 needs a CUDA device (use bf16 or off on the CPU)")
        return torch.float16
    raise ValueError(f"train.amp={amp!r}")  # unreachable: TrainConfig allows the four values above
