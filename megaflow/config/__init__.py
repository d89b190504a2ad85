"""Typed config tree, TOML loading with --set overrides, and validation."""
from megaflow.config.load import ConfigError, dump_config, load_config, run_dir_of, save_config
from megaflow.config.schema import MegaflowConfig

__all__ = ["ConfigError", "MegaflowConfig", "dump_config", "load_config", "run_dir_of", "save_config"]
