"""The inputs of ``megaflow eval reward``, standard library only: ``manifest.jsonl``, one JSON object a line
(``file``, ``prompt``, other keys = that image's metadata); each mistake one ValueError line naming file and line.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from megaflow.config.files import shown
from megaflow.config.load import check_value_shape
from megaflow.config.reward_check import check_custom_reward, check_reward_kwargs, check_reward_name
from megaflow.config.reward_files import MODEL_REWARDS, check_model_reward
from megaflow.data.prompts import json_object

MANIFEST = "manifest.jsonl"


@dataclass(frozen=True)
class ImageEntry:
    """One image of a folder: its manifest name, its path, its prompt and its metadata (the line's other keys)."""

    file: str
    path: Path
    prompt: str
    metadata: dict = field(default_factory=dict)


def _entry(images_dir: Path, where: str, line: str) -> ImageEntry:
    row = json_object(line, where, 'want a JSON object {"file", "prompt", ...}')
    for key in ("file", "prompt"):
        if not isinstance(row.get(key), str) or not row[key]:
            raise ValueError(f"{where}: needs a non-empty string {key!r}")
    path = images_dir / row["file"]
    try:
        inside, found = path.resolve().is_relative_to(images_dir.resolve()), path.is_file()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python < 3.13)
        raise ValueError(f"{where}: image {shown(row['file'])!r} cannot be opened ({e})") from None
    if not inside:
        raise ValueError(f"{where}: {shown(row['file'])!r} is outside the folder")
    if not found:
        raise ValueError(f"{where}: image {shown(row['file'])!r} not found in {images_dir} (or not a readable file)")
    metadata = {k: v for k, v in row.items() if k not in ("file", "prompt")}
    return ImageEntry(row["file"], path, row["prompt"], metadata)


def read_manifest(images_dir: str | Path) -> list[ImageEntry]:
    """The images ``images_dir/manifest.jsonl`` lists, in its order (see module docstring)."""
    images_dir = Path(images_dir)
    if not images_dir.is_dir():
        raise ValueError(f"--images {images_dir}: no such directory")
    manifest = images_dir / MANIFEST
    if not manifest.is_file():
        raise ValueError(f"--images {images_dir}: no {MANIFEST} (one {{\"file\", \"prompt\", ...}} a line)")
    try:
        lines = manifest.read_bytes().decode("utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(f"{manifest} is not UTF-8 text (want one JSON object a line)") from None
    entries = [_entry(images_dir, f"{manifest} line {n}", line) for n, line in enumerate(lines, 1) if line.strip()]
    if not entries:
        raise ValueError(f"{manifest} lists no images")
    return entries


def check_reward_args(name: str, kwargs_json: str | None, base: dict | None = None) -> dict:
    """The reward's keyword arguments: ``base`` (a config's ``reward.kwargs.<name>``) updated by ``--kwargs`` (a
    JSON object); ValueError for an unknown name or argument, a custom reward that does not resolve or bind, or a
    missing/malformed model reward directory."""
    check_reward_name(name, "--reward: ")
    if kwargs_json is None:
        kwargs_json = "{}"
    try:
        kwargs = json.loads(kwargs_json)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kwargs: not JSON ({e.msg}): {kwargs_json[:200]!r}") from None
    except RecursionError:
        raise ValueError("--kwargs: nested too deeply to read") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"--kwargs: want a JSON object such as '{{\"threads\": 2}}', got {kwargs_json[:200]!r}")
    check_value_shape("--kwargs", kwargs)
    kwargs = {**(base or {}), **kwargs}
    if ":" in name:  # imported, found and its arguments bound before any image is read
        check_custom_reward(name, kwargs, "--reward: ")
        return kwargs
    check_reward_kwargs(name, kwargs, "--kwargs ")
    if name in MODEL_REWARDS:  # its local model files, before torch loads anything
        check_model_reward(name, kwargs, where="--kwargs ")
    return kwargs
