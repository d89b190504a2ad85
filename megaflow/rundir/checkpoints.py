"""Run checkpoints: the layout of ``<run_dir>/checkpoints/iter_<n>/`` (``model/``: megatron dist checkpoint;
``state.json``). No heavy imports.

Invariant: a checkpoint is written into ``.staging-<iteration>`` and renamed only once complete, and renamed away
(``.removing-*``) before it is deleted, so an ``iter_*`` directory with a ``state.json`` is always whole; anything
else is removed by the next writer.
"""
from __future__ import annotations

import ast
import base64
import binascii
import json
import os
import re
import shutil
import uuid
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


REMOVING = ".removing-"  # a checkpoint being removed: renamed out of the iter_* names first


def remove_checkpoint(path: Path) -> None:
    """Remove a checkpoint dir so that no reader sees it half-deleted: renamed (atomically) to a hidden name that
    :func:`list_checkpoints` skips, then deleted; a writer killed meanwhile leaves only the hidden dir."""
    hidden = path.parent / f"{REMOVING}{path.name}-{uuid.uuid4().hex[:8]}"
    os.rename(path, hidden)
    shutil.rmtree(hidden, ignore_errors=True)


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
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: an integer of 4300+ digits
        raise ValueError(f"{path}: unreadable checkpoint state ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(state, dict) or "iteration" not in state:
        raise ValueError(f"{path}: not a megaflow checkpoint state (no 'iteration')")
    m = _NAME.match(Path(ckpt).name)
    for key, ok, want in _STATE_FIELDS:
        if (key in state or key in _REQUIRED) and not ok(state.get(key)):
            raise ValueError(f"{path}: {key} = {_brief(state.get(key))}: want {want}")
    if m and state["iteration"] != int(m.group(1)):
        raise ValueError(f"{path}: iteration = {state['iteration']}, but the checkpoint is {Path(ckpt).name}")
    return state


def check_resume(state: dict, ckpt: str | Path, *, algorithm: str, prompts_per_iter: int) -> None:
    """A checked ``state`` of ``ckpt`` (:func:`read_state`) fits the run resuming from it: written by the same
    algorithm (``algo.name``), and no more prompts consumed than its iterations and the batch sampled ahead drew
    (``rollout.prompts_per_iter`` each; the stream is replayed prompt by prompt on resume). A checkpoint without
    ``algorithm`` (megaflow before it was recorded) is taken as the config's: its run dir's config.toml, which a
    resume must match, names it. ValueError of one line naming the file."""
    path = Path(ckpt) / STATE_FILE
    saved = state.get("algorithm", algorithm)
    if saved != algorithm:
        raise ValueError(f"{path}: written by a {saved!r} run; algo.name = {algorithm!r} cannot continue it "
                         "(resume with the algorithm that wrote it, or start a new run.name)")
    most = (state["iteration"] + 1) * prompts_per_iter
    if state["prompts_consumed"] > most:
        raise ValueError(f"{path}: prompts_consumed = {state['prompts_consumed']}, more than the {most} that "
                         f"{state['iteration']} iterations and the batch ahead draw at rollout.prompts_per_iter = "
                         f"{prompts_per_iter}")


def _count(value: object, least: int = 0) -> bool:
    return type(value) is int and value >= least


_MT_WORDS = 624  # the Mersenne Twister state of python's random and numpy's legacy RandomState: 624 32-bit words
_TORCH_RNG_BYTES = 5056  # torch.get_rng_state() of the CPU generator


def _rng(value: object) -> bool:
    """One rank's RNG states as megaflow.rundir.checkpoint_io.rng_state writes them, every number in the range its
    generator accepts (python's and numpy's Mersenne Twister, torch's CPU generator state bytes)."""
    if not isinstance(value, dict) or set(value) != {"python", "numpy", "torch"}:
        return False
    numpy = value["numpy"]
    return (_python_rng(value["python"]) and _decoded_bytes(value["torch"]) == _TORCH_RNG_BYTES
            and isinstance(numpy, list) and len(numpy) == 5 and numpy[0] == "MT19937"
            and _decoded_bytes(numpy[1]) == 4 * _MT_WORDS and _count(numpy[2]) and numpy[2] <= _MT_WORDS
            and numpy[3] in (0, 1) and type(numpy[3]) is int and type(numpy[4]) in (int, float))


def _python_rng(text: object) -> bool:
    """``repr(random.getstate())``: (3, 624 words < 2**32 and a position <= 624, None or a float)."""
    if not isinstance(text, str) or len(text) > MAX_RNG_TEXT:
        return False
    try:
        version, words, gauss = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return (version == 3 and type(words) is tuple and len(words) == _MT_WORDS + 1
            and all(type(w) is int and 0 <= w < 2**32 for w in words) and words[-1] <= _MT_WORDS
            and (gauss is None or type(gauss) is float))


def _decoded_bytes(text: object) -> int:
    """Bytes of the base64 ``text``; -1 when it is none."""
    if not isinstance(text, str) or len(text) > MAX_RNG_TEXT:
        return -1
    try:
        return len(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError):
        return -1


def _metrics_row(row: object) -> bool:
    """A metrics row: a table of named values, its iteration an integer >= 0, its reward (summed when the run
    ends) a number."""
    return (isinstance(row, dict) and all(isinstance(k, str) for k in row) and _count(row.get("iteration"))
            and type(row.get("reward/total", 0.0)) in (int, float))


_REQUIRED = ("iteration", "prompts_consumed", "rng", "metrics")
_STATE_FIELDS = (  # key, check, what it must be
    ("iteration", lambda v: _count(v, 1), "an integer >= 1"),
    ("prompts_consumed", _count, "an integer >= 0"),
    ("rng", lambda v: isinstance(v, list) and v and all(map(_rng, v)),
     "a list of every rank's RNG states {python, numpy, torch} as python, numpy and torch give them"),
    ("metrics", lambda v: isinstance(v, list) and all(map(_metrics_row, v)),
     "a list of metrics rows {iteration (an integer >= 0), reward/total (a number), ...}"),
    ("algorithm", lambda v: isinstance(v, str) and 0 < len(v) <= 64, "the name of the algorithm that wrote it"),
    ("layout", lambda v: isinstance(v, dict) and set(v) == {"tp", "pp"} and all(_count(x, 1) for x in v.values()),
     "{tp, pp} of integers >= 1"),
    ("shadow_updates", lambda v: isinstance(v, dict) and all(isinstance(k, str) and _count(x) for k, x in v.items()),
     "a table of update counts >= 0"),
)


def _brief(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({type(value).__name__})"
