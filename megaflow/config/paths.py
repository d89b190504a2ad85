"""Paths a run file names are read relative to that file, as its ``base =`` is, so a config runs from any directory:
the files and directories of ``FILE_KEYS`` and a reward's ``*path`` arguments (``reward.kwargs.<reward>.path``, the
model rewards' local directories), and a custom reward module (``"myrewards:fn"``) beside the file.
Invariant: only values written in a file move (``--set`` values stay relative to the working directory); a relative
path that exists only under the working directory is still read there, with a one-line note (configs written
before this rule). Standard library only.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

# Config keys whose value is a file or directory (a special word in SPECIAL is not a path).
FILE_KEYS = (("model", "pretrained"), ("data", "prompts"), ("data", "test_prompts"), ("lora", "init"),
             ("pretrain", "init_from"))
SPECIAL = {("data", "prompts"): {"shapes"}}
_noted: set[str] = set()


def relative_to_file(file: Path, tables: dict) -> dict:
    """``tables`` (one run file's, ``{section: {key: value}}``) with each relative path of ``FILE_KEYS`` read from
    ``file``'s directory (see the module docstring)."""
    out = dict(tables)
    for section, key in FILE_KEYS:
        values = out.get(section)
        if not isinstance(values, dict) or not isinstance(values.get(key), str):
            continue
        value = values[key]
        if not value or os.path.isabs(value) or value in SPECIAL.get((section, key), ()):
            continue
        out[section] = {**values, key: _beside(file, f"{section}.{key}", value)}
    reward = out.get("reward")
    if isinstance(reward, dict) and isinstance(reward.get("kwargs"), dict):
        out["reward"] = {**reward, "kwargs": {name: _reward_paths(file, name, kwargs)
                                              for name, kwargs in reward["kwargs"].items()}}
    return out


def _reward_paths(file: Path, name: str, kwargs):
    if not isinstance(kwargs, dict):
        return kwargs
    return {k: _beside(file, f"reward.kwargs.{name}.{k}", v)
            if isinstance(k, str) and k.endswith("path") and isinstance(v, str) and v and not os.path.isabs(v) else v
            for k, v in kwargs.items()}


def _beside(file: Path, key: str, value: str) -> str:
    beside = os.path.normpath(os.path.join(file.parent, value))
    if os.path.lexists(beside) or not os.path.lexists(value):
        return beside
    note = f"{file}: {key} = {value!r}"
    if note not in _noted:
        _noted.add(note)
        print(f"megaflow: {note} is read relative to the working directory (it is not beside the config); "
              f"paths in a config are read relative to the config file: write {os.path.relpath(value, file.parent)!r}",
              file=sys.stderr)
    return value


def reward_modules_beside(file: Path, reward_names) -> None:
    """Make a custom reward module named in ``file`` (``"mod:fn"``, ``mod.py`` or the package ``mod/`` beside the
    file) importable in this process and the processes it starts, when it is not importable already."""
    from megaflow.config.dotted import is_dotted_path, module_findable
    folder = str(file.parent.resolve())
    for name in reward_names:
        if not isinstance(name, str) or not is_dotted_path(name):
            continue
        top = name.partition(":")[0].split(".")[0]
        if module_findable(top) or not (os.path.isfile(os.path.join(folder, f"{top}.py"))
                                        or os.path.isdir(os.path.join(folder, top))):
            continue
        if folder not in sys.path:
            sys.path.append(folder)
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if folder not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([*paths, folder])
