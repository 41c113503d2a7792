"""Reading configuration: YAML files, `section.key=value` overrides and checkpoints' stored configs
-> the checked dataclasses of `captioner.config.schema`, with the keys of older versions read.

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
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from captioner.config.schema import Config, ConfigError, EncoderConfig

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


def to_dict(cfg: Any) -> dict[str, Any]:
    """A dataclass config as plain nested dicts (YAML/JSON/checkpoint friendly)."""
    return dataclasses.asdict(cfg)


def from_dict(cls: type, data: dict[str, Any], where: str = "") -> Any:
    """Build dataclass `cls` from nested dicts, rejecting unknown keys and wrong types; the dataclass
    then checks its values (`captioner.config.schema`)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
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
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool) and ("off" if not value else "on") in choices:
            return "off" if not value else "on"  # YAML 1.1 reads an unquoted off / on as a boolean
        if value in choices:
            return value
        raise ConfigError(f"config key '{path}': {value!r} is not allowed (one of {', '.join(map(repr, choices))})")
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
    apply overrides, check. Every problem is a one-line ConfigError naming the file or the key."""
    data: dict[str, Any] = {}
    if path is not None:
        path = find_config(path)
        data = _read_yaml(path)
    data = apply_overrides(data, overrides or [])
    try:
        return parse_config(data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    if path.is_dir():
        raise ConfigError(f"{path}: is a folder, not a config file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte {e.object[e.start]:#04x})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML ({problem})") from None
    loaded = loaded or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (data:, model:, train:, decode:), "
                          f"got {type(loaded).__name__}")
    return loaded
