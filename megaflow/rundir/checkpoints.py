"""Run checkpoints: the layout of ``<run_dir>/checkpoints/iter_<n>/`` (``model/``: megatron dist checkpoint;
``state.json``). No heavy imports.

Invariant: a checkpoint is written into ``.staging-<iteration>`` and renamed only once complete, so an ``iter_*``
directory with a ``state.json`` is always whole; anything else is removed by the next writer.
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


MAX_RNG_TEXT = 1 << 16  # characters of one rank's python / numpy / torch RNG state (about 7 KB written)


def read_state(ckpt: str | Path) -> dict:
    """A checkpoint's ``state.json``, its types and ranges checked (what a resume reads of it): ValueError of one
    line naming the file and the first bad key when it is unreadable or wrong."""
    path = Path(ckpt) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"{path}: unreadable checkpoint state ({type(e).__name__})") from None
    if not isinstance(state, dict) or "iteration" not in state:
        raise ValueError(f"{path}: not a megaflow checkpoint state (no 'iteration')")
    m = _NAME.match(Path(ckpt).name)
    for key, ok, want in _STATE_FIELDS:
        if (key in state or key in _REQUIRED) and not ok(state.get(key)):
            raise ValueError(f"{path}: {key} = {_brief(state.get(key))}: want {want}")
    if m and state["iteration"] != int(m.group(1)):
        raise ValueError(f"{path}: iteration = {state['iteration']}, but the checkpoint is {Path(ckpt).name}")
    return state


def _count(value: object, least: int = 0) -> bool:
    return type(value) is int and value >= least


def _rng(value: object) -> bool:
    """One rank's RNG states as megaflow.rundir.checkpoint_io.rng_state writes them."""
    if not isinstance(value, dict) or not all(isinstance(value.get(k), str) and len(value[k]) <= MAX_RNG_TEXT
                                              for k in ("python", "torch")):
        return False
    numpy = value.get("numpy")
    return (isinstance(numpy, list) and len(numpy) == 5 and all(isinstance(x, str) for x in numpy[:2])
            and len(numpy[1]) <= MAX_RNG_TEXT and _count(numpy[2]) and _count(numpy[3])
            and type(numpy[4]) in (int, float))


_REQUIRED = ("iteration", "prompts_consumed", "rng", "metrics")
_STATE_FIELDS = (  # key, check, what it must be
    ("iteration", lambda v: _count(v, 1), "an integer >= 1"),
    ("prompts_consumed", _count, "an integer >= 0"),
    ("rng", lambda v: isinstance(v, list) and v and all(map(_rng, v)),
     "a list of every rank's RNG states {python, numpy, torch}"),
    ("metrics", lambda v: isinstance(v, list) and all(isinstance(r, dict) for r in v), "a list of metrics rows"),
    ("layout", lambda v: isinstance(v, dict) and set(v) == {"tp", "pp"} and all(_count(x, 1) for x in v.values()),
     "{tp, pp} of integers >= 1"),
    ("shadow_updates", lambda v: isinstance(v, dict) and all(isinstance(k, str) and _count(x) for k, x in v.items()),
     "a table of update counts >= 0"),
)


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({type(value).__name__})"
