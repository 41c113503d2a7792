"""Where code runs: device choice and seeding."""
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
