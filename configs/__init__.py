"""Configuration: the typed schema (`schema.py`), the strict loader (`loader.py`), what the entry points'
command lines tell about it (`cli.py`: --help-config, --print-config) and the YAML recipes.

    from configs import load_config
    cfg = load_config(["configs/pretrain/vit_b.yaml"], ["optim.lr=1e-3"])
"""
from .loader import ConfigError, apply_overrides, config_from_dict, config_to_dict, layer_config, load_config
from .schema import (CDConfig, Config, DataConfig, LogConfig, ModelConfig, OptimConfig, QuantConfig,
                     SchedConfig, TrainConfig, TWEOConfig)

# the recipe train.py runs when given no --config (the README's first command), and a sweep without config files
DEFAULT_CONFIG = "configs/demo/vit_digits.yaml"

__all__ = ["DEFAULT_CONFIG", "ConfigError", "load_config", "layer_config", "apply_overrides", "config_from_dict",
           "config_to_dict", "Config", "ModelConfig", "DataConfig", "OptimConfig",
           "SchedConfig", "TrainConfig", "LogConfig", "CDConfig", "TWEOConfig", "QuantConfig"]
