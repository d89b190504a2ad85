"""Run checkpoints: the layout of ``<run_dir>/checkpoints`` (no heavy imports; the CLI and export read it).

    <run_dir>/checkpoints/iter_000010/model/       megatron dist checkpoint (any TP/PP layout) + optimizer,
                                                   with megaflow_model.json (megaflow.trainer.checkpoint)
    <run_dir>/checkpoints/iter_000010/state.json   iteration, prompt-stream position, RNG states, metrics rows

A checkpoint is written into ``.staging-<iteration>`` and renamed to ``iter_<iteration>`` only once
complete, so a directory named ``iter_*`` with a ``state.json`` is always a whole checkpoint; anything
else (a staging dir left by a killed writer) is ignored and removed by the next writer.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
STATE_FILE = "state.json"
MODEL_DIR = "model"
_NAME = re.compile(r"^iter_(\d{6,})$")


def checkpoint_dir(run_dir: str | Path, iteration: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"iter_{iteration:06d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as (iteration, directory), oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _NAME.match(d.name)
        if m and (d / STATE_FILE).is_file() and (d / MODEL_DIR).is_dir():
            found.append((int(m.group(1)), d))
    return sorted(found)


def find_checkpoint(run_dir: str | Path, iteration: int | None = None) -> tuple[int, Path]:
    """The checkpoint of ``iteration`` (None = the latest); ValueError naming what is missing."""
    found = list_checkpoints(run_dir)
    if not found:
        raise ValueError(f"{run_dir}: no checkpoints (expected {Path(run_dir) / CHECKPOINTS}/iter_*/{STATE_FILE})")
    if iteration is None:
        return found[-1]
    for it, d in found:
        if it == iteration:
            return it, d
    raise ValueError(f"{run_dir}: no checkpoint of iteration {iteration} (have {[it for it, _ in found]})")


def read_state(ckpt: str | Path) -> dict:
    """A checkpoint's ``state.json``; ValueError (naming the file) when it is unreadable."""
    path = Path(ckpt) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable checkpoint state ({type(e).__name__})") from None
    if not isinstance(state, dict) or "iteration" not in state:
        raise ValueError(f"{path}: not a megaflow checkpoint state (no 'iteration')")
    return state
