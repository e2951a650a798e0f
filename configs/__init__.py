"""Run configs: the YAML files in this directory and their typed schema."""

from forgeline.configs.loader import ConfigError, load_config, resolve_config_path, shipped_configs
from forgeline.configs.schema import Config

__all__ = ["Config", "ConfigError", "load_config", "resolve_config_path", "shipped_configs"]
