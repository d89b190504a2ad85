"""The run directory's checks have one home (megaflow.run.rundir): the CLI's ``check_run_dir`` (nothing created
or locked) and rank 0's claim ``RunDir`` (under the lock) give the same verdict with the same words.
Needs: CPU, 1 process, no torch (< 1 s)."""
from __future__ import annotations

import json

import pytest

from megaflow.config import load_config, save_config
from megaflow.run.checkpoints import MODEL_DIR, STATE_FILE, checkpoint_dir
from megaflow.run.rundir import RunDir, check_run_dir


def _cfg(tmp_path, *overrides):
    return load_config(None, [f'run.output_dir="{tmp_path}"', 'run.name="r"', "train.iterations=4", *overrides])


def _checkpoint(cfg, run_dir, iteration):
    """A run dir as a run that checkpointed ``iteration`` leaves it (its config and one checkpoint)."""
    d = checkpoint_dir(run_dir, iteration)
    (d / MODEL_DIR).mkdir(parents=True)
    (d / STATE_FILE).write_text(json.dumps({"iteration": iteration}))
    save_config(cfg, run_dir)


def _verdicts(cfg, resume: bool) -> tuple[str, str]:
    """(check_run_dir's error, RunDir's error); "" where it accepts."""
    out = []
    for check in (lambda: check_run_dir(cfg, resume=resume), lambda: RunDir(cfg, resume=resume).release(failed=True)):
        try:
            check()
            out.append("")
        except ValueError as e:
            out.append(str(e))
    return out[0], out[1]


@pytest.mark.parametrize("case, needle", [
    ("resume, no dir", "nothing to resume"),
    ("a file", "is not a directory"),
    ("checkpoints, no resume", "pass --resume"),
    ("finished", "already finished"),
    ("other config", "differs from the checkpointed run"),
    ("resume, no checkpoint", "no checkpoint to resume from"),
    ("fresh", ""),
])
def test_check_run_dir_and_the_claim_agree(tmp_path, case, needle):
    cfg, resume = _cfg(tmp_path), case.startswith("resume") or case in ("finished", "other config")
    run_dir = tmp_path / "r"
    if case == "a file":
        run_dir.write_text("")
    elif case == "resume, no checkpoint":
        run_dir.mkdir()
    elif case in ("checkpoints, no resume", "finished", "other config"):
        _checkpoint(cfg, run_dir, 4 if case == "finished" else 2)
        if case == "other config":
            cfg = _cfg(tmp_path, "train.lr=0.5")
    ours, claims = _verdicts(cfg, resume)
    assert ours == claims, (ours, claims)
    assert needle in ours if needle else ours == ""
