"""A run's ``eval.jsonl``: one row per evaluation, at the iteration it stands for (0 before training, the last
iteration after). Invariant: a resumed run keeps the rows up to the iteration it resumes after and no later ones,
so no iteration is evaluated twice in the record.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

EVAL_LOG = "eval.jsonl"


def iteration_of(when: str | int, iterations: int) -> int:
    """The iteration an evaluation stands for: 0 before training, ``iterations`` after, else ``when``."""
    if when == "before":
        return 0
    if when == "after":
        return iterations
    return int(when)


def record(run_dir: Path, when: str | int, iterations: int, figures: dict) -> dict:
    """Append ``{"iteration", "when", **figures}`` to ``<run_dir>/eval.jsonl`` (``when``: "before", "after", or
    "iteration" for an evaluation between iterations); the row."""
    row = {"iteration": iteration_of(when, iterations), "when": when if isinstance(when, str) else "iteration",
           **figures}
    with open(Path(run_dir) / EVAL_LOG, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row, sort_keys=True) + "\n")
    return row


def resume_eval_log(run_dir: Path, start: int) -> list[dict]:
    """Before a run resumed after iteration ``start`` evaluates: eval.jsonl keeps its rows up to ``start`` (an
    "after" among them becomes "iteration": the run goes on past it) and loses the later ones; the kept rows."""
    path = Path(run_dir) / EVAL_LOG
    if not path.is_file():
        return []
    rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    kept = [{**r, "when": "iteration" if r.get("when") == "after" else r.get("when")} for r in rows
            if r.get("iteration", 0) <= start]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in kept), encoding="utf-8")
    os.replace(tmp, path)
    return kept
