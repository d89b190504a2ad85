"""Run files that build on another: ``base = "other.toml"`` (relative to the naming file) starts from the base,
then this file's keys replace the base's, key by key (a table value replaces the whole table, not a merge).
Design notes: docs/design/config.md.
"""
from __future__ import annotations

from pathlib import Path

from megaflow.config.load import MAX_CONFIG_BYTES, ConfigError, parse_toml

BASE_KEY = "base"
MAX_DEPTH = 16  # files in one chain: beyond, a chain is a mistake, not a design


def read_toml(path: Path, named_by: str) -> dict:
    """The tables of one TOML run file; ConfigError naming it (and ``named_by``: who asked for it)."""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}{named_by}")
    if (size := path.stat().st_size) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {size} bytes, larger than the {MAX_CONFIG_BYTES >> 20} MiB a run file may be "
                          "(one is a few KB)")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a UTF-8 text file (TOML run files are UTF-8)") from None
    return parse_toml(text, str(path))


def config_layers(path: str | Path) -> list[tuple[Path, dict]]:
    """``[(file, its tables without 'base'), ...]``, the farthest base first and ``path`` last."""
    chain: list[tuple[Path, dict]] = []
    path, named_by = Path(path), ""
    seen: list[Path] = []
    while True:
        resolved = path.resolve()
        if resolved in seen:
            loop = " -> ".join(p.name for p in [*seen, resolved])
            raise ConfigError(f"{seen[-1]}: base = {path.name!r} makes a cycle ({loop})")
        if len(seen) >= MAX_DEPTH:
            raise ConfigError(f"{path}: more than {MAX_DEPTH} files in one chain of base = ...")
        seen.append(resolved)
        data = read_toml(path, named_by)
        base = data.pop(BASE_KEY, None)
        chain.append((path, data))
        if base is None:
            return chain[::-1]
        reward = data.get("reward")
        if isinstance(reward, dict) and "weights" in reward and "kwargs" not in reward:
            reward["kwargs"] = {}  # a file that names its own rewards does not keep its base's rewards' arguments
        if not isinstance(base, str) or not base:
            raise ConfigError(f"{path}: base must be the path of another run file (a string), got {base!r}")
        named_by = f" (the base of {path})"
        path = path.parent / base
