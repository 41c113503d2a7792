"""Configuration: small frozen dataclasses, parsed from YAML files and `section.key=value` overrides.

Everything that reads a file or the command line into configuration lives here. Functions elsewhere
take the sub-config (or plain arguments) they need, never the whole `Config`.

Shipped configs live in `captioner/configs/` (package data): `--config shapes` finds
`captioner/configs/shapes.yaml` from anywhere, `--config configs/shapes.yaml` from the repository.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import yaml

from captioner.errors import CaptionerError

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class ConfigError(CaptionerError):
    """A configuration file or override that does not fit the dataclasses (one-line message)."""


@dataclass(frozen=True)
class DataConfig:
    path: str = "shapes"  # a folder or caption file (layout detected), or "shapes" for the built-in set
    val_fraction: float = 0.1  # used only when the source has no split of its own
    test_fraction: float = 0.0
    split_seed: int = 0
    min_word_count: int = 1  # rarer words become <unk>
    max_length: int = 20  # words per caption, without <start>/<end>; longer captions are cut
    cache_dir: str = ""  # feature cache folder; "" = <out>/cache
    use_cache: bool = True  # with a frozen encoder, compute each image's grid once
    augment: bool = False  # train-time augmentation (only without the cache)
    num_workers: int = 0
    shapes_images: int = 1000  # size of the built-in shapes set
    shapes_seed: int = 0


@dataclass(frozen=True)
class EncoderConfig:
    name: str = "efficientnet_lite0"
    image_size: int = 256  # square input side, pixels
    weights: str = ""  # local state dict; "" = the backbone's own pretrained weights
    trainable_stages: int = 0  # fine-tune the last N stages (0 = frozen, eval mode)


@dataclass(frozen=True)
class DecoderConfig:
    embed_dim: int = 256
    hidden_dim: int = 512
    attention_dim: int = 256
    dropout: float = 0.5
    feature_dim: int = 512  # project the encoder's D-wide regions to this width once per image (0 = keep D)
    position: bool = True  # add learned row + column embeddings to the regions, so attention can select by place
    gate: bool = True  # Show-Attend-Tell's beta = sigmoid(Linear(h)) on the context
    init_pooling: str = "mean"  # "mean" | "attention" | "none" (zeros): how the grid becomes the initial state
    # "before": attend with the state from before the previous word was read (Show, Attend and Tell);
    # "after": read it first, then attend with the new state, so the query knows the word just written
    attend: str = "before"


@dataclass(frozen=True)
class ModelConfig:
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 20
    batch_size: int = 64
    optimizer: str = "adamw"  # "adam" | "adamw"
    lr: float = 4e-4
    encoder_lr: float = 1e-4  # for the fine-tuned encoder stages
    weight_decay: float = 0.0
    grad_clip: float = 5.0
    schedule: str = "cosine"  # "cosine" | "constant"
    warmup_steps: int = 0
    # Weight of the doubly stochastic attention term, mean over regions of (1 - sum_t alpha)^2: every
    # region looked at about once per caption. 6.4 = the 0.1 per summed region measured best on
    # flickr8k-800's 64 regions (val CIDEr 0.531 vs 0.495 at 1.0 summed).
    coverage_weight: float = 6.4
    entropy_weight: float = 0.0  # attention entropy penalty: sharper maps, one object per look
    label_smoothing: float = 0.0
    scheduled_sampling: float = 0.0  # final probability of feeding the model's own word
    amp: str = "auto"  # "auto" | "bf16" | "fp16" | "off"
    seed: int = 0
    val_every_steps: int = 0  # 0 = validate once per epoch
    val_images: int = 0  # 0 = all validation images
    val_metric: str = "CIDEr"
    patience: int = 5  # epochs (validations) without improvement before stopping; 0 = never stop early
    checkpoint_every_steps: int = 0  # also write last.pt every N steps (0 = at the end of each epoch only)
    group_by_image: bool = True  # an image's captions share a batch: its grid is projected once for all of them
    log_every: int = 10


@dataclass(frozen=True)
class DecodeConfig:
    beam_size: int = 5
    max_length: int = 20
    length_penalty: float = 1.0  # rank finished captions by logprob / length ** length_penalty
    no_repeat_ngram: int = 0  # 0 = off


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)


def to_dict(cfg: Any) -> dict[str, Any]:
    """A dataclass config as plain nested dicts (YAML/JSON/checkpoint friendly)."""
    return dataclasses.asdict(cfg)


def from_dict(cls: type, data: dict[str, Any], where: str = "") -> Any:
    """Build dataclass `cls` from nested dicts, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            raise ConfigError(f"unknown config key '{path}' (known: {', '.join(sorted(names))})")
        kwargs[key] = _coerce(hints[key], value, path)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value if value is not None else {}, path)
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(arg, value, path)
            except ConfigError:
                continue
        raise ConfigError(f"config key '{path}': {value!r} is not a {tp}")
    if tp is type(None):
        if value is None:
            return None
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if value is None:
            return ""
    else:  # pragma: no cover - only the types above are used in the dataclasses
        raise ConfigError(f"config key '{path}': unsupported type {tp}")
    name = getattr(tp, "__name__", str(tp))
    raise ConfigError(f"config key '{path}': expected {name}, got {value!r} ({type(value).__name__})")


# --- keys of older versions ------------------------------------------------------------------

# Keys that existed once and do nothing now: a config file or a resumed run's saved config that
# still sets one loads with a warning instead of failing as an unknown key.
RETIRED_KEYS: dict[tuple[str, str], str] = {
    ("train", "length_buckets"): "the packed teacher-forced pass never computes padding",
}


def legacy_regions(encoder: dict[str, Any]) -> int:
    """L = H'·W' of an encoder section (name, image_size) as older versions built it: every backbone
    but `random` has a total stride of 32 with "same"-rounded sizes, `random` 16. Only the
    `alpha_reg` alias needs this; tests check it against the real backbones."""
    name = encoder.get("name", EncoderConfig.name)
    size = encoder.get("image_size", EncoderConfig.image_size)
    stride = 16 if name == "random" else 32
    return math.ceil(size / stride) ** 2


def _alpha_reg(value: Any, data: dict[str, Any]) -> Any:
    """alpha_reg weighted the coverage term summed over the L regions; coverage_weight weighs its
    mean, so the same loss takes alpha_reg * L."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config key 'train.alpha_reg': expected float, got {value!r} ({type(value).__name__})")
    encoder = (data.get("model") or {}).get("encoder") or {}
    return value * legacy_regions(encoder if isinstance(encoder, dict) else {})


# Keys that were renamed: (section, old) -> (new, convert(old value, whole config) -> new value, why).
# The old key is read (converted to the new meaning) with a warning; it is never written.
RENAMED_KEYS: dict[tuple[str, str], tuple[str, Callable[[Any, dict[str, Any]], Any], str]] = {
    ("train", "alpha_reg"): ("coverage_weight", _alpha_reg,
                             "the coverage term now averages over regions: alpha_reg x regions"),
    ("train", "entropy_reg"): ("entropy_weight", lambda v, _: v, "renamed"),
}


def _upgrade(data: dict[str, Any]) -> dict[str, Any]:
    """Drop RETIRED_KEYS and rename RENAMED_KEYS in nested dicts (a copy), with a warning for each."""
    data = _deep_copy(data)
    for (section, key), why in RETIRED_KEYS.items():
        node = data.get(section)
        if isinstance(node, dict) and key in node:
            del node[key]
            log.warning("config key '%s.%s' is no longer used (%s); ignored", section, key, why)
    for (section, old), (new, convert, why) in RENAMED_KEYS.items():
        node = data.get(section)
        if isinstance(node, dict) and old in node:
            value = node.pop(old)
            if new in node:
                log.warning("config key '%s.%s' ignored: '%s.%s' is set too", section, old, section, new)
                continue
            node[new] = convert(value, data)
            log.warning("config key '%s.%s' is now '%s.%s' (%s): read as %s.%s=%s", section, old, section, new,
                        why, section, new, node[new])
    return data


# --- reading ---------------------------------------------------------------------------------


def parse_config(data: dict[str, Any]) -> Config:
    """Nested dicts (a YAML file's, a checkpoint's) -> Config, reading the keys of older versions."""
    return from_dict(Config, _upgrade(data))


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` strings (value parsed as YAML) to nested dicts; returns a new dict."""
    data = _deep_copy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form section.key=value")
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{item}': '{k}' is not a section")
        try:
            node[keys[-1]] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override '{item}': cannot parse value ({e.__class__.__name__})") from None
    return data


def _deep_copy(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in d.items()}


def shipped_configs() -> list[str]:
    """Names of the configs that ship with the package (`--config NAME`)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def find_config(name: str | Path) -> Path:
    """A config file by path, or by the name of a shipped config (`shapes`, `shapes.yaml`)."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    shipped = CONFIG_DIR / f"{Path(name).name.removesuffix('.yaml')}.yaml"
    if path.parent == Path(".") or path.parent.name == "configs":
        if shipped.is_file():
            return shipped
    raise ConfigError(f"{name}: config file not found (shipped configs: {', '.join(shipped_configs())})")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config (a path or a shipped config's name; the defaults when `path` is None),
    apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        path = find_config(path)
        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
        data = loaded or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
    data = apply_overrides(data, overrides or [])
    try:
        return parse_config(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None
