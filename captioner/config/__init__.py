"""Configuration: frozen, self-checking dataclasses (`schema`) and their reading from YAML files,
overrides and checkpoints (`parse`). Functions elsewhere take the section (or plain arguments)
they need, never the whole `Config`."""
from captioner.config.parse import (
    CONFIG_DIR,
    apply_overrides,
    find_config,
    from_dict,
    legacy_regions,
    load_config,
    parse_config,
    shipped_configs,
    to_dict,
)
from captioner.config.schema import (
    LIMITS,
    Config,
    ConfigError,
    DataConfig,
    DecodeConfig,
    DecoderConfig,
    EncoderConfig,
    ModelConfig,
    TrainConfig,
)

__all__ = ["CONFIG_DIR", "LIMITS", "Config", "ConfigError", "DataConfig", "DecodeConfig", "DecoderConfig",
           "EncoderConfig", "ModelConfig", "TrainConfig", "apply_overrides", "find_config", "from_dict",
           "legacy_regions", "load_config", "parse_config", "shipped_configs", "to_dict"]
