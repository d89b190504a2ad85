"""Ctrl-C as a terminal sends it (SIGINT to the whole process group) during a run that evaluates every iteration:
the engine workers ignore it (no engine restart), the driver stops after the current iteration with its checkpoint
and the evaluation due at that iteration, within seconds of the checkpoint; then ``--resume`` with a changed
evaluation size and learning rate is accepted and listed in one line, and a changed group size is refused naming
the key before anything starts. Needs: CPU, real SGLang engine, 1 process; ~2 min (slow)."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest

from resume_harness import Launch, write_config

pytestmark = [pytest.mark.slow, pytest.mark.engine]


def _rows(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def test_ctrl_c_keeps_the_due_evaluation_and_a_resume_may_change_what_is_safe(tmp_path):
    held = tmp_path / "held.txt"
    held.write_text("a red circle\na green square\n")
    evaluation = ("--set", "eval.every=1", "--set", "eval.num=2", "--set", f'data.test_prompts="{held}"')
    config, run_dir = write_config(tmp_path, "ctrl_c", 1), tmp_path / "runs" / "ctrl_c"
    launch = Launch(config, nproc=1, resume=False, extra=evaluation)
    while launch.proc.poll() is None and not any(r["iteration"] == 1 for r in _rows(run_dir / "metrics.jsonl")):
        time.sleep(0.05)
    os.killpg(launch.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    rc, _, err = launch.wait()
    exited = time.time()
    assert rc == 130, err[-3000:]
    assert "restarting after crash" not in err and "exited:" not in err, err[-3000:]
    stopped = int(err.split("stopped by SIGINT after iteration ")[1].split()[0])
    state = run_dir / "checkpoints" / f"iter_{stopped:06d}" / "state.json"
    assert exited - state.stat().st_mtime < 30, "the stop took long after the checkpoint"
    evaluated = [(r["iteration"], r["when"]) for r in _rows(run_dir / "eval.jsonl")]
    assert evaluated == [(0, "before"), *[(i, "iteration") for i in range(1, stopped + 1)]], evaluated
    launch.assert_no_orphans()

    refused = Launch(config, nproc=1, resume=True, extra=(*evaluation, "--set", "rollout.group_size=4"))
    rc, _, err = refused.wait()
    assert rc == 2 and "rollout.group_size = 4 differs" in err and "--resume-override rollout.group_size" in err
    assert len(err.strip().splitlines()) == 1, err

    changed = ("--set", "eval.every=1", "--set", "eval.num=1", "--set", f'data.test_prompts="{held}"',
               "--set", "train.lr=1e-3", "--set", "train.iterations=3")
    resumed = Launch(config, nproc=1, resume=True, extra=changed)
    rc, out, err = resumed.wait()
    assert rc == 0, err[-3000:]
    said = [x for x in out.splitlines() if "--resume with a changed config" in x]
    assert len(said) == 1 and "train.lr 0.003 -> 0.001" in said[0] and "eval.num 2 -> 1" in said[0], out[-2000:]
    rows = _rows(run_dir / "eval.jsonl")
    assert [r["iteration"] for r in rows] == list(range(0, 4)), rows  # no evaluation lost or repeated
    assert [r["eval/num"] for r in rows[stopped + 1:]] == [1] * (3 - stopped)
