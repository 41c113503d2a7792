import pytest

from captioner.config import Config, ConfigError, load_config


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 0.001\nmodel:\n  encoder:\n    name: random\n")
    cfg = load_config(path, ["train.epochs=3", "model.decoder.gate=false", "train.lr=2e-4"])
    assert isinstance(cfg, Config)
    assert cfg.train.epochs == 3 and cfg.train.lr == 2e-4
    assert cfg.model.encoder.name == "random" and cfg.model.decoder.gate is False
    assert cfg.decode.beam_size == 5  # untouched default


@pytest.mark.parametrize(
    "override, words",
    [
        ("train.lrr=1", ["train.lrr", "unknown"]),
        ("train.epochs=abc", ["train.epochs", "int"]),
        ("model.decoder.gate=3", ["model.decoder.gate", "bool"]),
        ("nosection.x=1", ["nosection", "unknown"]),
        ("train.epochs", ["section.key=value"]),
    ],
)
def test_bad_keys_and_types_give_one_line_errors(override, words):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_bad_file_names_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  epochs: [\n")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(path)
    with pytest.raises(ConfigError, match="missing.yaml: config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_a_retired_key_is_dropped_with_a_warning_not_an_error(tmp_path, caplog):
    path = tmp_path / "old.yaml"
    path.write_text("train:\n  length_buckets: true\n  epochs: 3\n")
    with caplog.at_level("WARNING"):
        cfg = load_config(path)
    assert cfg.train.epochs == 3 and cfg == load_config(None, ["train.epochs=3"])
    assert "train.length_buckets" in caplog.text and "ignored" in caplog.text
    with pytest.raises(ConfigError, match="unknown config key 'train.length_bucket'"):
        load_config(None, ["train.length_bucket=true"])  # a typo is still an error


def test_renamed_keys_are_read_with_a_warning(tmp_path, caplog):
    path = tmp_path / "old.yaml"
    path.write_text("model:\n  encoder: {image_size: 256}\ntrain:\n  alpha_reg: 0.1\n  entropy_reg: 0.02\n")
    with caplog.at_level("WARNING"):
        cfg = load_config(path)
    # the old term summed over the 8x8 = 64 regions of efficientnet_lite0 at 256 px; the new one averages
    assert cfg.train.coverage_weight == pytest.approx(6.4) and cfg.train.entropy_weight == 0.02
    assert "train.alpha_reg" in caplog.text and "train.coverage_weight" in caplog.text
    assert "train.entropy_reg" in caplog.text
    with pytest.raises(ConfigError, match="alpha_reg"):
        load_config(None, ["train.alpha_reg=much"])


@pytest.mark.parametrize("name, size", [("random", 64), ("random", 70), ("efficientnet_lite0", 256),
                                        ("efficientnet_lite2", 260), ("resnet50", 224), ("convnext_tiny", 224)])
def test_the_alias_counts_the_regions_the_encoder_really_has(name, size):
    from captioner.config import EncoderConfig, legacy_regions
    from captioner.model.encoder import build_encoder

    grid = build_encoder(EncoderConfig(name=name, image_size=size), pretrained=False).grid
    assert legacy_regions({"name": name, "image_size": size}) == grid[0] * grid[1]


def test_shipped_configs_are_found_by_name_from_anywhere(tmp_path, monkeypatch):
    from captioner.config import shipped_configs

    monkeypatch.chdir(tmp_path)
    assert shipped_configs() == ["coco", "flickr8k", "flickr8k-800", "flickr8k-800-scst", "flickr8k-scst", "shapes"]
    init = ["train.init=ce.pt"]  # the scst config needs the checkpoint it starts from
    for name in shipped_configs():
        assert load_config(name, init) == load_config(f"configs/{name}.yaml", init) == load_config(f"{name}.yaml", init)
    assert load_config("shapes").model.decoder.attend == "after"
    with pytest.raises(ConfigError, match="shapez: config file not found .*shipped configs: coco"):
        load_config("shapez")


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_a_seed_numpy_cannot_take_fails_when_the_config_is_read(seed):
    """numpy seeds only 0 to 2**32 - 1: a train.seed outside fails with the config, before any data or model."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"train.seed={seed}"])
    assert "\n" not in str(e.value) and f"'train.seed': {seed} is not allowed" in str(e.value)
    assert load_config(None, [f"train.seed={2**32 - 1}"]).train.seed == 2**32 - 1
