"""The run directory's checks have one home (megaflow.rundir.claim): the CLI's ``check_run_dir`` (nothing created
or locked) and rank 0's claim ``RunDir`` (under the lock) give the same verdict with the same words.
Needs: CPU, 1 process, no torch (< 1 s)."""
from __future__ import annotations

import base64
import errno
import hashlib
import json
import os
import random
from pathlib import Path

import pytest

from megaflow.config import load_config, save_config
from megaflow.config.files import CKPT_META
from megaflow.rundir import claim
from megaflow.rundir.checkpoints import MODEL_DIR, STATE_FILE, checkpoint_dir
from megaflow.rundir.claim import RunDir, check_run_dir


# A state.json as megaflow.rundir.checkpoint_io.save writes it (one rank's RNG states: python's as random gives
# it, numpy's and torch's of the sizes they have, zero bytes).
RNG = {"python": repr(random.Random(0).getstate()), "torch": base64.b64encode(bytes(5056)).decode(),
       "numpy": ["MT19937", base64.b64encode(bytes(4 * 624)).decode(), 624, 0, 0.0]}
STATE = {"prompts_consumed": 0, "rng": [RNG], "metrics": [], "layout": {"tp": 1, "pp": 1}}


def _cfg(tmp_path, *overrides):
    return load_config(None, [f'run.output_dir="{tmp_path}"', 'run.name="r"', "train.iterations=4", *overrides])


def _checkpoint(cfg, run_dir, iteration, *, config=True):
    """A run dir as a run that checkpointed ``iteration`` leaves it (its config, unless lost, and one checkpoint
    with the family and layout it was saved with, and the metrics so far)."""
    d = checkpoint_dir(run_dir, iteration)
    (d / MODEL_DIR).mkdir(parents=True)
    (d / MODEL_DIR / CKPT_META).write_text(json.dumps({"format": 1, "family": cfg.model.family}))
    (d / STATE_FILE).write_text(json.dumps(STATE | {"iteration": iteration}))
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"iteration": {i}}}\n' for i in range(iteration + 1)))
    if config:
        save_config(cfg, run_dir)


def _edit_state(run_dir: Path, iteration: int, **changes) -> None:
    path = checkpoint_dir(run_dir, iteration) / STATE_FILE
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def _hashes(root: Path) -> dict[str, str]:
    """Every entry under ``root``, symlinks not followed: a file's SHA-256, a link's target, or "dir"."""
    out = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(top) / name
            kind = ("-> " + os.readlink(p)) if p.is_symlink() else "dir" if p.is_dir() else \
                hashlib.sha256(p.read_bytes()).hexdigest()
            out[str(p.relative_to(root))] = kind
    return out


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
    ("other config", "rollout.group_size = 8 differs from the checkpointed run's 4"),
    ("resume, no checkpoint", "no checkpoint to resume from"),
    ("resume, config lost, other family", "model.family = 'flux' differs from the checkpoint's 'sd3'"),
    ("resume, config lost, other tp", "parallel.tp = 2 differs from the checkpoint's 1"),
    ("resume, config saved with an old spelling", ""),
    ("resume, an awm checkpoint in a flowgrpo run", "written by a 'awm' run; algo.name = 'flowgrpo' cannot"),
    ("resume, a flowgrpo checkpoint", ""),
    ("resume, a checkpoint that does not say its algorithm", ""),  # megaflow before it did: the config's
    ("resume, every prompt 2 iterations and the batch ahead drew", ""),
    ("resume, one prompt more", "prompts_consumed = 13, more than the 12 that 2 iterations"),
    ("output_dir a file", "run.output_dir = "),
    ("output_dir a dangling symlink", "a dangling symlink (to "),
    ("a dangling symlink", "r is a dangling symlink"),
    ("a symlink outside output_dir", "outside run.output_dir"),
    ("name too long", "file name too long"),
    ("a symlink inside output_dir", ""),
    ("fresh", ""),
])
def test_check_run_dir_and_the_claim_agree(tmp_path, case, needle):
    runs = tmp_path / "runs"
    cfg, resume = _cfg(runs), case.startswith("resume") or case in ("finished", "other config")
    run_dir = runs / "r"
    if case not in ("output_dir a file", "output_dir a dangling symlink"):
        runs.mkdir()
    if case == "a file":
        run_dir.write_text("")
    elif case == "resume, no checkpoint":
        run_dir.mkdir()
    elif case in ("checkpoints, no resume", "finished", "other config"):
        _checkpoint(cfg, run_dir, 4 if case == "finished" else 2)
        if case == "other config":
            cfg = _cfg(runs, "rollout.group_size=8")
    elif case == "resume, config saved with an old spelling":  # bridge.mode = "colocated", now "shared_memory"
        _checkpoint(cfg, run_dir, 2)
        saved = run_dir / "config.toml"
        saved.write_text(saved.read_text().replace('mode = "shared_memory"', 'mode = "colocated"'))
        assert 'mode = "colocated"' in saved.read_text()
    elif case in ("resume, an awm checkpoint in a flowgrpo run", "resume, a flowgrpo checkpoint",
                  "resume, a checkpoint that does not say its algorithm"):
        _checkpoint(cfg, run_dir, 2)
        if "does not say" not in case:
            _edit_state(run_dir, 2, algorithm=case.split()[2])
    elif case in ("resume, every prompt 2 iterations and the batch ahead drew", "resume, one prompt more"):
        _checkpoint(cfg, run_dir, 2)  # rollout.prompts_per_iter = 4
        _edit_state(run_dir, 2, prompts_consumed=13 if "more" in case else 12)
    elif case.startswith("resume, config lost"):
        _checkpoint(cfg, run_dir, 2, config=False)
        cfg = _cfg(runs, "model.family=flux" if "family" in case else "parallel.tp=2")
    elif case == "output_dir a file":
        runs.write_text("")
    elif case == "output_dir a dangling symlink":
        runs.symlink_to(tmp_path / "nowhere")
    elif case == "a dangling symlink":
        run_dir.symlink_to(tmp_path / "nowhere")
    elif case == "a symlink outside output_dir":
        (tmp_path / "elsewhere").mkdir()
        run_dir.symlink_to(tmp_path / "elsewhere")
    elif case == "a symlink inside output_dir":
        (runs / "r2").mkdir()
        run_dir.symlink_to(runs / "r2")
    elif case == "name too long":
        cfg = _cfg(runs, f'run.name="{"n" * 300}"')
    before = _hashes(tmp_path)
    ours, claims = _verdicts(cfg, resume)
    assert ours == claims, (ours, claims)
    assert needle in ours if needle else ours == ""
    if needle:
        assert _hashes(tmp_path) == before, "a refused claim wrote files"


def test_failed_resume_writes_nothing_and_the_right_one_is_accepted(tmp_path):
    """Resuming a run whose config.toml was lost with another family's config is refused before anything is
    written; the run's own config then resumes it (check_run_dir, then the claim, which a failure before the
    first iteration undoes byte for byte)."""
    ours = _cfg(tmp_path)
    run_dir = tmp_path / "r"
    _checkpoint(ours, run_dir, 2, config=False)
    before = _hashes(tmp_path)
    other = _cfg(tmp_path, "model.family=flux")
    for check in (lambda: check_run_dir(other, resume=True), lambda: RunDir(other, resume=True)):
        with pytest.raises(ValueError, match="model.family = 'flux' differs"):
            check()
        assert _hashes(tmp_path) == before
    check_run_dir(ours, resume=True)
    claim = RunDir(ours, resume=True)
    assert (claim.resume_iteration, claim.resume_from) == (2, checkpoint_dir(run_dir, 2))
    save_config(ours, run_dir)  # what the driver writes next (megaflow.run.roles.share_pipeline)
    claim.release(failed=True)  # e.g. the checkpoint would not load
    assert _hashes(tmp_path) == before, "a resume that failed before its first iteration left files"


def test_failed_resume_puts_back_the_config_it_found(tmp_path):
    cfg, run_dir = _cfg(tmp_path), tmp_path / "r"
    _checkpoint(cfg, run_dir, 2)
    longer = _cfg(tmp_path, "train.iterations=8")
    before = _hashes(tmp_path)
    claim = RunDir(longer, resume=True)
    save_config(longer, run_dir)
    claim.release(failed=True)
    assert _hashes(tmp_path) == before
    claim = RunDir(longer, resume=True)
    save_config(longer, run_dir)
    claim.first_iteration_done()
    claim.release(failed=True)  # after an iteration the run's record stays
    assert "iterations = 8" in (run_dir / "config.toml").read_text()


def test_unwritable_output_dir_is_one_line(tmp_path, monkeypatch):
    """A folder this process may not write (chmod 0o555; as root, where chmod stops nothing, os.access says
    so), and an OS error while the claim makes the dir (a read-only file system), are one ValueError line."""
    runs = tmp_path / "runs"
    runs.mkdir()
    cfg = _cfg(runs)
    if os.geteuid() == 0:
        monkeypatch.setattr(claim.os, "access", lambda path, mode: False)
    else:
        runs.chmod(0o555)
    assert _verdicts(cfg, False) == (f"run.output_dir = {str(runs)!r}: not writable (permission denied)",) * 2
    monkeypatch.undo()
    runs.chmod(0o755)

    def read_only(self, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ValueError, match=r"^run dir '.*r': read-only file system$"):
        RunDir(cfg, resume=False)
    assert os.listdir(runs) == []


def test_resume_accepts_the_safe_changes_and_lists_them(tmp_path):
    """Evaluation, logging, the learning rate and iterations may change on resume (the claim lists them); a
    change of what the run trains is refused naming the key unless ``--resume-override`` names it, and the
    overridden change is listed as such. check_run_dir and the claim agree."""
    from megaflow.config.resume_changes import describe_changes
    cfg, run_dir = _cfg(tmp_path), tmp_path / "r"
    _checkpoint(cfg, run_dir, 2)
    safe = _cfg(tmp_path, "train.lr=0.5", "eval.num=7", "train.iterations=8", "logging.log_every=3")
    check_run_dir(safe, resume=True)
    claim = RunDir(safe, resume=True)
    claim.release(failed=True)
    assert {c.key for c in claim.changes} == {"train.lr", "eval.num", "train.iterations", "logging.log_every"}
    line = describe_changes(claim.changes)
    assert "\n" not in line and f"train.lr {cfg.train.lr!r} -> 0.5" in line and "eval.num" in line, line
    meaning = _cfg(tmp_path, "train.lr=0.5", "rollout.group_size=8", "algo.kl_beta=0.5")
    for check in (lambda: check_run_dir(meaning, resume=True), lambda: RunDir(meaning, resume=True)):
        with pytest.raises(ValueError, match=r"rollout.group_size = 8 differs.*--resume-override rollout.group_size"):
            check()
    with pytest.raises(ValueError, match=r"algo.kl_beta = 0.5 differs"):
        check_run_dir(meaning, resume=True, overrides=("rollout.group_size",))
    both = ("rollout.group_size", "algo.kl_beta")
    check_run_dir(meaning, resume=True, overrides=both)
    claim = RunDir(meaning, resume=True, overrides=both)
    claim.release(failed=True)
    line = describe_changes(claim.changes, both)
    assert "rollout.group_size 4 -> 8 (--resume-override)" in line and "(--resume-override)" not in \
        line.split("train.lr")[1].split(",")[0], line


def test_resume_without_config_overrides_the_layout_only_when_named(tmp_path):
    cfg, run_dir = _cfg(tmp_path), tmp_path / "r"
    _checkpoint(cfg, run_dir, 2, config=False)
    other = _cfg(tmp_path, "parallel.tp=2")
    with pytest.raises(ValueError, match="parallel.tp = 2 differs from the checkpoint's 1"):
        check_run_dir(other, resume=True)
    check_run_dir(other, resume=True, overrides=("parallel.tp",))
