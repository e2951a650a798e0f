"""Run configs: the YAML files in this directory, their typed schema (`schema.py`), the loader
that applies `section.key=value` overrides (`loader.py`) and the process environment forgeline
runs with (`environment.py`).

The bottom layer: it imports no other forgeline package (configs <- model <- eval <- tasks <-
flows; tests/unit/test_imports.py enforces the direction).
"""

from forgeline.configs.loader import load_config, resolve_config_path, shipped_configs
from forgeline.configs.schema import Config, ConfigError

__all__ = ["Config", "ConfigError", "load_config", "resolve_config_path", "shipped_configs"]
