"""Load, override, validate and save megaflow configs.

``load_config(path, overrides)`` reads a TOML run file (its paths relative to it: megaflow.config.paths), applies
``--set section.key=value`` (TOML literals, bare words as strings) and validates everything before any work: each
mistake is one ConfigError line naming key and value. ``save_config`` writes the resolved config atomically; ``run_dir_of`` says where.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile
import tomllib
from collections import Counter
from pathlib import Path
from typing import Any

from megaflow.config.schema import MegaflowConfig
from megaflow.config.suggest import clipped, suggest_key, suggest_section
from megaflow.parallel.dims import ParallelDims


class ConfigError(ValueError):
    """A user mistake in a config file, an override or an input file they name; the message is one line
    naming the key or the file."""


_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "list": list, "dict": dict}
MAX_CONFIG_BYTES = 1 << 20  # a run file is a few KB; a larger one is refused before it is parsed
MAX_NESTING = 16  # lists / tables inside a config value (reward.kwargs tables nest 2-3 deep)
MAX_ITEMS = 4096  # entries of one list or table in a config value
RENAMED_VALUES = {("bridge", "mode"): {"colocated": "shared_memory"}}
"""Old spellings of a value that users' configs (and saved runs' config.toml) still hold: read as the new one."""
_noted: set[str] = set()


def current_value(section: str, key: str, value: Any) -> Any:
    """``value`` of ``section.key`` in its current spelling (RENAMED_VALUES), else as given."""
    renamed = RENAMED_VALUES.get((section, key), {})
    return renamed.get(value, value) if isinstance(value, str) else value


def current_values(data: dict) -> dict:
    """A parsed config (``{section: {key: value}}``) with every old spelling replaced (``current_value``)."""
    return {section: {k: current_value(section, k, v) for k, v in values.items()} if isinstance(values, dict)
            else values for section, values in data.items()}


def _read_renamed(where: str, section: str, key: str, value: Any) -> Any:
    """``current_value``, with a one-line note on stderr (once a process) when the spelling is an old one."""
    new = current_value(section, key, value)
    if new is not value and (note := f"{section}.{key} = {value!r}") not in _noted:
        _noted.add(note)
        print(f"megaflow: {where}{note} is deprecated, read as {new!r}; write {section}.{key} = {new!r}",
              file=sys.stderr)
    return new


def check_value_shape(key: str, value: Any) -> None:
    """ConfigError when ``value`` nests more than MAX_NESTING lists / tables deep or one of them holds more than
    MAX_ITEMS entries (an iterative walk: no recursion on hostile input)."""
    todo = [(value, 0)]
    while todo:
        v, depth = todo.pop()
        if not isinstance(v, (list, dict)):
            continue
        if depth >= MAX_NESTING:
            raise ConfigError(f"{key}: nested more than {MAX_NESTING} lists or tables deep")
        if len(v) > MAX_ITEMS:
            raise ConfigError(f"{key}: {len(v)} entries in one {'list' if isinstance(v, list) else 'table'}, "
                              f"more than the {MAX_ITEMS} a config value may have")
        todo.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))


def parse_toml(text: str, where: str) -> dict:
    """``tomllib.loads(text)``; ConfigError (``where: ...``) when it is not TOML or nests too deeply to parse."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: invalid TOML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply to read (a config value nests at most {MAX_NESTING} "
                          "lists or tables)") from None


def _field_type(f: dataclasses.Field) -> type:
    t = f.type if isinstance(f.type, str) else f.type.__name__
    if t not in _TYPES:
        raise TypeError(f"unsupported config field type {t!r} for {f.name}")
    return _TYPES[t]


def _coerce(key: str, value: Any, f: dataclasses.Field) -> Any:
    want = _field_type(f)
    check_value_shape(key, value)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if want is int and isinstance(value, bool) or not isinstance(value, want):
        raise ConfigError(f"{key}: expected {want.__name__}, got {type(value).__name__} {clipped(repr(value))}")
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
        raise ConfigError(f"{where}unknown section {clipped(repr(section))}{suggest_section(cfg, section)} (known: "
                          f"{', '.join(sections)})")
    if not isinstance(values, dict):
        raise ConfigError(f"{where}section {section!r} must be a table, got {clipped(repr(values))}")
    obj = getattr(cfg, section)
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"{where}unknown key {clipped(f'{section}.{key}')} = {clipped(repr(value))}"
                              f"{suggest_key(cfg, section, key)}")
        value = _read_renamed(where, section, key, value)
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
    except RecursionError:
        raise ConfigError(f"--set {dotted.strip()}: nested too deeply to read (a config value nests at most "
                          f"{MAX_NESTING} lists or tables)") from None
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
        raise ConfigError(f"rollout.sde_window: step indices {bad[:8]} not in [0, {r.num_steps})")
    repeated = sorted(i for i, n in Counter(r.sde_window).items() if n > 1)
    if repeated:
        raise ConfigError(f"rollout.sde_window: step{'s' if len(repeated) > 1 else ''} {repeated[:8]} listed more "
                          "than once (each step is sampled with SDE or not: list it once)")
    if r.sde_type == "cps" and not r.log_prob_no_const:
        raise ConfigError("rollout.sde_type = 'cps' requires rollout.log_prob_no_const = true (log-prob is -inf at the last step otherwise)")
    for name, w in cfg.reward.weights.items():
        if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w):
            raise ConfigError(f"reward.weights.{name}: weight must be a finite number, got {w!r}")
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> MegaflowConfig:
    """Build a validated config from defaults, an optional TOML file (over its ``base`` files:
    megaflow.config.inherit), and ``--set`` overrides; a field none of them names takes its algorithm's default
    where it has one (megaflow.config.algo_defaults), ``model.family`` the pretrained pipeline's
    (megaflow.config.model_family)."""
    from megaflow.config.algo_defaults import apply_algorithm_defaults
    from megaflow.config.inherit import config_layers  # it raises this module's ConfigError
    from megaflow.config.model_family import infer_family
    from megaflow.config.paths import relative_to_file, reward_modules_beside
    cfg, explicit = MegaflowConfig(), set()
    for file, data in config_layers(path) if path is not None else []:  # a file's bases first (base = "...")
        data = relative_to_file(file, data)  # its paths are read from its folder
        reward = data.get("reward")
        if isinstance(reward, dict) and isinstance(reward.get("weights"), dict):
            reward_modules_beside(file, reward["weights"])
        for section, values in data.items():
            _apply_section(cfg, section, values, f"{file.name}: ", explicit)
    for text in overrides:
        section, key, value = parse_override(text)
        _apply_section(cfg, section, {key: value}, "--set ", explicit)
    return validate(apply_algorithm_defaults(infer_family(cfg, explicit), explicit))


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
