"""Image encoder: a pretrained CNN whose last feature map becomes a grid of L = H'·W' region vectors.

Shapes: B batch, S input side (pixels), D encoder width, H' x W' feature grid, L = H'·W' regions.

D and the grid are read from a dummy forward at build time, never hard-coded. The backbones and
their weights are `captioner.model.backbones`'.

Two-scale (`model.encoder.two_scale`): the grid of the stage at half the last stage's stride (16 x 16
cells at 256 px on EfficientNet-Lite), each cell its own d features followed by the D of the last
stage's cell it lies in (nearest upsampling): D' = d + D. The last stage says what is there, the finer
stage where inside that cell; the classifier-facing last-stage channels stay the grid's last D.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import PIL.Image
import timm
import torch
import torchvision
from torch import Tensor, nn
from torchvision import transforms as T

from captioner.config import EncoderConfig
from captioner.model.backbones import Backbone, build_backbone
from captioner.model.weights import EncoderError
from captioner.model.grid import CPU_CHUNK, Cells


def _rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    return image if image.mode == "RGB" else image.convert("RGB")


def eval_transform(image_size: int, interpolation: T.InterpolationMode, mean: Sequence[float],
                   std: Sequence[float]) -> Callable[[PIL.Image.Image], Tensor]:
    """PIL image -> (3, S, S) normalised tensor, the preprocessing of inference (and of the cache):
    one square resize (aspect not kept, nothing cropped away), ToTensor, the weights' normalisation."""
    size = (image_size, image_size)
    return T.Compose([_rgb, T.Resize(size, interpolation=interpolation, antialias=True), T.ToTensor(),
                      T.Normalize(mean, std)])


class Encoder(nn.Module):
    """A backbone as a grid encoder: (B, 3, S, S) normalised images -> (B, L, D) region features.

    Frozen stages are always in eval mode with requires_grad False (BatchNorm statistics never
    drift); only the last `trainable_stages` stages train and follow `train(mode)`.
    """

    def __init__(self, name: str, image_size: int, backbone: Backbone, trainable_stages: int = 0,
                 two_scale: bool = False) -> None:
        super().__init__()
        if two_scale and backbone.fine_stage is None:
            raise EncoderError(f"{name}: model.encoder.two_scale is not available for this backbone")
        if not 0 <= trainable_stages <= len(backbone.stages):
            raise EncoderError(f"{name}: model.encoder.trainable_stages={trainable_stages} is out of range "
                               f"(0..{len(backbone.stages)})")
        self.name = name
        self.image_size = image_size
        self.backbone = backbone.net
        self.mean, self.std = backbone.mean, backbone.std
        self.interpolation = backbone.interpolation
        self._trainable = [n for group in backbone.stages[len(backbone.stages) - trainable_stages:] for n in group]
        for p in self.backbone.parameters():
            p.requires_grad_(False)
        for n in self._trainable:
            for p in self.backbone.get_submodule(n).parameters():
                p.requires_grad_(True)
        self.backbone.eval()
        # two-scale: the net as two halves run in turn (plain attributes: the modules stay the backbone's)
        self._halves = _split(self.backbone, backbone.fine_stage) if two_scale else None
        self.two_scale = two_scale
        with torch.no_grad():  # measure D and the grid once, on a dummy image
            dummy = torch.zeros(1, 3, image_size, image_size)
            if two_scale:
                lower, upper = self._halves
                fine = lower(dummy)  # (1, d, 2H, 2W)
                coarse = upper(fine)  # (1, D, H, W)
                fmap = _stack_scales(fine, coarse)  # (1, d + D, 2H, 2W)
            else:
                fmap = self.backbone(dummy)  # (1, D, H', W')
        self.out_dim: int = fmap.shape[1]
        # the trailing channels that every 2x2 block of cells shares (two-scale: the last stage's D), 0 if none
        self.block_dim: int = coarse.shape[1] if two_scale else 0
        self.grid: tuple[int, int] = (fmap.shape[2], fmap.shape[3])
        origin, stride = (backbone.fine_geometry if two_scale else backbone.geometry)(image_size)
        self.cells = Cells(origin / image_size, stride / image_size)
        self.train()

    @property
    def frozen(self) -> bool:
        """True when no stage is fine-tuned."""
        return not self._trainable

    def train(self, mode: bool = True) -> Encoder:
        """Only the fine-tuned stages follow `mode`; everything else stays in eval mode."""
        self.training = mode
        self.backbone.eval()
        for n in self._trainable:
            self.backbone.get_submodule(n).train(mode)
        return self

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters of the fine-tuned stages (empty when frozen)."""
        return [p for p in self.parameters() if p.requires_grad]

    def forward(self, images: Tensor) -> Tensor:
        """Args:
            images: (B, 3, S, S) normalised images (see `transform`).
        Returns:
            (B, L, D) region features, L = H'·W' in row-major order.
        """
        if images.device.type == "cpu":  # oneDNN convs run ~1.5-2x faster NHWC on CPU, same numbers (1e-6)
            images = images.contiguous(memory_format=torch.channels_last)
        return self._fmap(images).flatten(2).transpose(1, 2)  # (B, L, D); contiguous when the map is NHWC

    def _fmap(self, images: Tensor) -> Tensor:
        """(B, 3, S, S) -> (B, D, H', W'): the last stage's map, or the two-scale map (module docstring)."""
        if self._halves is None:
            return self.backbone(images)  # (B, D, H', W')
        lower, upper = self._halves
        fine = lower(images)  # (B, d, 2H, 2W)
        return _stack_scales(fine, upper(fine))  # (B, d + D, 2H, 2W)

    @torch.inference_mode()
    def infer(self, images: Tensor) -> Tensor:
        """`forward` for inference over a batch of any size: (B, 3, S, S) -> (B, L, D).

        On a CPU the CNN runs fastest on one or two images at a time (their activations stay in
        cache: efficientnet_lite0 at 480 px on 2 cores, 7.9 images/s in chunks of 2 against 4.4 in
        one batch of 32), so the batch goes through in chunks of CPU_CHUNK; on a GPU all at once.
        """
        chunk = CPU_CHUNK if images.device.type == "cpu" else len(images)
        return torch.cat([self(images[i : i + chunk]) for i in range(0, len(images), chunk)])  # (B, L, D)

    def transform(self, train: bool = False) -> Callable[[PIL.Image.Image], Tensor]:
        """PIL image -> (3, S, S) normalised tensor: a square resize (aspect not kept, nothing cropped
        away, so every region of the photo is in the grid), ToTensor, the weights' normalisation.

        Args:
            train: add modest augmentation: a crop of 80-100% of the area and small colour jitter.
                No horizontal flip: captions say "left" and "right".
        """
        if not train:
            return eval_transform(self.image_size, self.interpolation, self.mean, self.std)
        size = (self.image_size, self.image_size)
        resize = [T.Resize(size, interpolation=self.interpolation, antialias=True),
                  T.RandomResizedCrop(size, scale=(0.8, 1.0), ratio=(0.9, 1.1), interpolation=self.interpolation,
                                      antialias=True),
                  T.ColorJitter(brightness=0.2, contrast=0.2, saturation=0.2)]
        return T.Compose([_rgb, *resize, T.ToTensor(), T.Normalize(self.mean, self.std)])

    def cache_key(self) -> str:
        """Everything the features depend on, stable across processes: backbone, input size, resize and
        normalisation, a digest of the weights actually loaded (so another weights file, or a package
        update that changes them, never meets features made with the old ones), timm and torchvision
        versions. E.g. "efficientnet_lite0-256-bicubic-m0.5,0.5,0.5-s0.5,0.5,0.5-w1a2b3c4d5e6f-timm1.0.19-tv0.29.1"."""
        digest = hashlib.sha256()
        for name, tensor in self.backbone.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        norm = lambda v: ",".join(f"{x:g}" for x in v)
        return (f"{self.name}-{self.image_size}{'-2scale' if self.two_scale else ''}-{self.interpolation.value}"
                f"-m{norm(self.mean)}-s{norm(self.std)}"
                f"-w{digest.hexdigest()[:12]}-timm{timm.__version__}-tv{torchvision.__version__}")


def build_encoder(cfg: EncoderConfig, pretrained: bool = True) -> Encoder:
    """Build the encoder `cfg` names.

    Args:
        cfg: backbone name, input size, optional local weights file, number of fine-tuned stages.
        pretrained: load weights (cfg.weights, else the backbone's own). False builds the
            architecture only, with no network or file access (a checkpoint fills the weights).
    Returns:
        An `Encoder` on the CPU, frozen parts in eval mode.
    """
    return Encoder(cfg.name, cfg.image_size, build_backbone(cfg, pretrained), cfg.trainable_stages, cfg.two_scale)


def _stack_scales(fine: Tensor, coarse: Tensor) -> Tensor:
    """(B, d, 2H, 2W) finer stage, (B, D, H, W) last stage -> (B, d + D, 2H, 2W): each fine cell's own
    channels, then those of the last-stage cell it lies in (nearest upsampling)."""
    B, D, H, W = coarse.shape
    # nearest upsampling as an expand: exports to ONNX ops whose shapes its tools infer (a Resize's they do not)
    coarse = coarse[:, :, :, None, :, None].expand(B, D, H, 2, W, 2).reshape(B, D, 2 * H, 2 * W)
    return torch.cat([fine, coarse], dim=1)  # (B, d + D, 2H, 2W)


def _split(net: nn.Sequential, after: str) -> tuple[nn.Sequential, nn.Sequential]:
    """`net` as two Sequentials that run one after the other: everything up to and including the
    submodule `after` (a child, "block2", or a child's child, "blocks.4"), and the rest. They hold
    `net`'s own modules."""
    top, _, inner = after.partition(".")
    lower: list[nn.Module] = []
    upper: list[nn.Module] = []
    side = lower
    for name, child in net.named_children():
        if name != top:
            side.append(child)
            continue
        parts = list(child.named_children()) if inner else [(name, child)]
        cut = [n for n, _ in parts].index(inner or name) + 1
        lower += [m for _, m in parts[:cut]]
        upper += [m for _, m in parts[cut:]]
        side = upper
    return nn.Sequential(*lower), nn.Sequential(*upper)
