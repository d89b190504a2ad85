"""Load, override, validate and save megaflow configs.

``load_config(path, overrides)`` reads a TOML run file, applies ``--set section.key=value``
overrides (values parsed as TOML literals, bare words as strings) and validates everything
before any work starts: an unknown key, a wrong type or an out-of-range value raises
:class:`ConfigError` with one line naming the key and the value. ``save_config`` writes the
resolved config (TOML) into the run directory atomically; ``run_dir_of`` says where that directory is.
"""
from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import tomllib
from pathlib import Path
from typing import Any

from megaflow.config.schema import MegaflowConfig
from megaflow.parallel.dims import ParallelDims


class ConfigError(ValueError):
    """A user mistake in a config file, an override or an input file they name; the message is one line
    naming the key or the file."""


_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict}


def _field_type(f: dataclasses.Field) -> type:
    t = f.type if isinstance(f.type, str) else f.type.__name__
    if t not in _TYPES:
        raise TypeError(f"unsupported config field type {t!r} for {f.name}")
    return _TYPES[t]


def _coerce(key: str, value: Any, f: dataclasses.Field) -> Any:
    want = _field_type(f)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if want is int and isinstance(value, bool) or not isinstance(value, want):
        raise ConfigError(f"{key}: expected {want.__name__}, got {type(value).__name__} {value!r}")
    if want is float and not math.isfinite(value):
        raise ConfigError(f"{key}: value {value!r} is not a finite number")
    meta = f.metadata
    if "items" in meta:
        item = meta["items"]
        bad = [v for v in value if not isinstance(v, item) or (item is int and isinstance(v, bool))]
        if bad:
            raise ConfigError(f"{key}: expected a list of {item.__name__}, got {type(bad[0]).__name__} "
                              f"{bad[0]!r} in {value!r}")
    checks = (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
              ("le", lambda v, b: v <= b, "<="), ("lt", lambda v, b: v < b, "<"))
    for name, ok, sym in checks:
        if name in meta and not ok(value, meta[name]):
            raise ConfigError(f"{key}: value {value!r} out of range (must be {sym} {meta[name]})")
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{key}: value {value!r} not one of {', '.join(map(str, meta['choices']))}")
    return value


def _apply_section(cfg: MegaflowConfig, section: str, values: dict, where: str, explicit: set[str]) -> None:
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    if section not in sections:
        raise ConfigError(f"{where}unknown section {section!r} (known: {', '.join(sections)})")
    if not isinstance(values, dict):
        raise ConfigError(f"{where}section {section!r} must be a table, got {values!r}")
    obj = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"{where}unknown key {section}.{key} = {value!r}")
        setattr(obj, key, _coerce(f"{where}{section}.{key}", value, fields[key]))
        explicit.add(f"{section}.{key}")


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse ``section.key=value``; the value is a TOML literal, or a bare string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    dotted, raw = text.split("=", 1)
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {text!r}: key must be section.key, got {dotted.strip()!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts[0], parts[1], value


def validate(cfg: MegaflowConfig) -> MegaflowConfig:
    """Cross-field checks that single-field ranges cannot express."""
    r = cfg.rollout
    try:
        ParallelDims.of(cfg.parallel)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    bad = [i for i in r.sde_window if not isinstance(i, int) or not 0 <= i < r.num_steps]
    if bad:
        raise ConfigError(f"rollout.sde_window: step indices {bad} not in [0, {r.num_steps})")
    if r.sde_type == "cps" and not r.log_prob_no_const:
        raise ConfigError("rollout.sde_type = 'cps' requires rollout.log_prob_no_const = true (log-prob is -inf at the last step otherwise)")
    for name, w in cfg.reward.weights.items():
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w):
            raise ConfigError(f"reward.weights.{name}: weight must be a finite number, got {w!r}")
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> MegaflowConfig:
    """Build a validated config from defaults, an optional TOML file, and ``--set`` overrides; a field neither
    names takes its algorithm's default where it has one (megaflow.config.algo_defaults)."""
    from megaflow.config.algo_defaults import apply_algorithm_defaults
    cfg, explicit = MegaflowConfig(), set()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = tomllib.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not a UTF-8 text file (TOML run files are UTF-8)") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        for section, values in data.items():
            _apply_section(cfg, section, values, f"{path.name}: ", explicit)
    for text in overrides:
        section, key, value = parse_override(text)
        _apply_section(cfg, section, {key: value}, "--set ", explicit)
    return validate(apply_algorithm_defaults(cfg, explicit))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_toml_value(str(k))} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def dump_config(cfg: MegaflowConfig) -> str:
    """The config as TOML text (round-trips through load_config)."""
    lines = []
    for sec in dataclasses.fields(cfg):
        lines.append(f"[{sec.name}]")
        for f in dataclasses.fields(getattr(cfg, sec.name)):
            lines.append(f"{f.name} = {_toml_value(getattr(getattr(cfg, sec.name), f.name))}")
        lines.append("")
    return "\n".join(lines)


def run_dir_of(cfg: MegaflowConfig) -> Path:
    """``<run.output_dir>/<run.name>``; ValueError when the name is not a single path component."""
    name = cfg.run.name
    if not name or "/" in name or "\\" in name or "\0" in name or name.startswith("."):
        raise ValueError(f"run.name = {name!r}: must be one path component (no '/', not empty, not starting "
                         "with '.'); the run directory is <run.output_dir>/<run.name>")
    return Path(cfg.run.output_dir) / name


def save_config(cfg: MegaflowConfig, run_dir: str | Path) -> Path:
    """Write ``config.toml`` into run_dir atomically (temp file + rename) and return its path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=".config.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write(dump_config(cfg))
    dst = run_dir / "config.toml"
    os.replace(tmp, dst)
    return dst
