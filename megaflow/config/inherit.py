"""Run files that build on another: ``base = "other.toml"`` (relative to the naming file) starts from the base,
then this file's keys replace the base's, key by key (a table value replaces the whole table, not a merge).
Design notes: docs/design/config.md.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from megaflow.config.files import shown
from megaflow.config.load import MAX_CONFIG_BYTES, ConfigError, parse_toml
from megaflow.config.suggest import clipped

BASE_KEY = "base"
MAX_DEPTH = 16  # files in one chain: beyond, a chain is a mistake, not a design


def read_toml(path: Path, named_by: str = "") -> dict:
    """The tables of one TOML run file; ConfigError naming it (and ``named_by``: who asked for it) when it is
    missing, a symlink loop, not a regular file (a directory, a FIFO, a device: never read), over
    ``MAX_CONFIG_BYTES`` (at most that much is read), not UTF-8 or not TOML."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {shown(path)}{named_by}") from None
    except OSError as e:  # a symlink loop, a name too long, no permission
        raise ConfigError(f"{shown(path)}{named_by}: {e.strerror or type(e).__name__}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{shown(path)}{named_by}: not a regular file (a TOML run file is one)")
    if info.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{shown(path)}: {info.st_size} bytes, larger than the {MAX_CONFIG_BYTES >> 20} MiB a run "
                          "file may be (one is a few KB)")
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)  # a file growing meanwhile is still read no further
        text = data.decode("utf-8")
    except OSError as e:
        raise ConfigError(f"{shown(path)}{named_by}: {e.strerror or type(e).__name__}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{shown(path)}: not a UTF-8 text file (TOML run files are UTF-8)") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{shown(path)}: larger than the {MAX_CONFIG_BYTES >> 20} MiB a run file may be")
    return parse_toml(text, str(path))


def config_layers(path: str | Path) -> list[tuple[Path, dict]]:
    """``[(file, its tables without 'base'), ...]``, the farthest base first and ``path`` last."""
    chain: list[tuple[Path, dict]] = []
    path, named_by = Path(path), ""
    seen: list[Path] = []
    while True:
        data = read_toml(path, named_by)  # first: a missing file or a symlink loop is one line, not resolve()'s
        resolved = path.resolve()
        if resolved in seen:
            loop = " -> ".join(p.name for p in [*seen, resolved])
            raise ConfigError(f"{seen[-1]}: base = {path.name!r} makes a cycle ({loop})")
        if len(seen) >= MAX_DEPTH:
            raise ConfigError(f"{path}: more than {MAX_DEPTH} files in one chain of base = ...")
        seen.append(resolved)
        base = data.pop(BASE_KEY, None)
        chain.append((path, data))
        if base is None:
            return chain[::-1]
        reward = data.get("reward")
        if isinstance(reward, dict) and "weights" in reward and "kwargs" not in reward:
            reward["kwargs"] = {}  # a file that names its own rewards does not keep its base's rewards' arguments
        if not isinstance(base, str) or not base:
            raise ConfigError(f"{path}: base must be the path of another run file (a string), got "
                              f"{clipped(repr(base))}")
        named_by = f" (the base of {path})"
        path = path.parent / base
