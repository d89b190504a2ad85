"""Ownership of a run directory (``<run.output_dir>/<run.name>``), taken by rank 0 before any work.

- The name is one path component: a run never writes outside ``run.output_dir``.
- One run at a time: an exclusive ``flock`` on ``<run_dir>/.lock`` is held for the whole run; a second
  run with the same name refuses with one line instead of interleaving its metrics.
- A run dir with checkpoints is continued only with ``--resume``; without it the command refuses. A
  finished run (its last checkpoint is at ``train.iterations``) is never overwritten; resuming it needs
  a larger ``train.iterations``. A run dir without checkpoints (a run killed before its first save)
  starts over.
- Resuming needs the same config as the checkpointed run, except ``train.iterations`` and logging.
- A run that fails before its first iteration completes leaves nothing behind (if it created the dir).

The checks are made twice by one set of functions: by the CLI before anything heavy is imported
(:func:`check_run_dir`, nothing created or locked) and again by rank 0's claim under the lock (:class:`RunDir`).
"""
from __future__ import annotations

import fcntl
import os
import shutil
import tomllib
from pathlib import Path

from megaflow.config import MegaflowConfig, dump_config, run_dir_of
from megaflow.run.checkpoints import list_checkpoints

LOCK_FILE = ".lock"
# Sections and keys a resumed run may change: how long it runs and what it prints.
_RESUMABLE_CHANGES = {("train", "iterations"), ("train", "save_every"), ("train", "keep_checkpoints")}
_RESUMABLE_SECTIONS = {"logging"}


class RunDir:
    """The claimed run directory; ``resume_from`` is the checkpoint dir to continue from (or None)."""

    def __init__(self, cfg: MegaflowConfig, *, resume: bool):
        self.path = run_dir_of(cfg)
        self.created = False
        self.resume_from: Path | None = None
        self.resume_iteration = 0
        self._lock_fh = None
        if not _check_path(self.path, resume=resume):
            self.path.mkdir(parents=True)
            self.created = True
        self._lock()
        try:
            self._check_history(cfg, resume=resume)
        except BaseException:
            self.release(failed=True)
            raise

    def _lock(self) -> None:
        fh = open(self.path / LOCK_FILE, "a+")
        try:
            _take_lock(fh, self.path, fcntl.LOCK_EX)
        except ValueError:
            fh.close()
            raise
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        self._lock_fh = fh

    def _check_history(self, cfg: MegaflowConfig, *, resume: bool) -> None:
        found = _resumable(self.path, cfg, resume=resume)
        if found is not None:
            self.resume_iteration, self.resume_from = found

    def release(self, *, failed: bool) -> None:
        """Unlock; a run that ``failed`` before its first iteration removes the dir it created."""
        if self._lock_fh is not None:
            self._lock_fh.close()
            self._lock_fh = None
        if failed and self.created and not list_checkpoints(self.path):
            shutil.rmtree(self.path, ignore_errors=True)

    def first_iteration_done(self) -> None:
        """From now on a failure keeps the dir (its metrics and checkpoints are the run's record)."""
        self.created = False


def with_unused_name(cfg: MegaflowConfig) -> MegaflowConfig:
    """``cfg`` with ``run.name`` made unique in ``run.output_dir`` (``name``, ``name-1``, ``name-2``, ...): for
    commands that are rerun as a whole (the demo, benchmarks) instead of continued."""
    import dataclasses
    base = run_dir_of(cfg)
    name, n = cfg.run.name, 0
    while (base.parent / name).exists():
        n += 1
        name = f"{cfg.run.name}-{n}"
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=name))


def check_run_dir(cfg: MegaflowConfig, *, resume: bool) -> None:
    """The claim's checks without taking it (nothing created or locked): the CLI runs this before any
    heavy import so a refused run dir is one line at once; :class:`RunDir` makes the same checks under the lock."""
    path = run_dir_of(cfg)
    if not _check_path(path, resume=resume):
        return
    lock = path / LOCK_FILE
    if lock.is_file():
        with open(lock) as fh:
            _take_lock(fh, path, fcntl.LOCK_SH)
    _resumable(path, cfg, resume=resume)


def _check_path(path: Path, *, resume: bool) -> bool:
    """Whether the run dir exists; ValueError when it is not a directory, or ``resume`` finds none."""
    if not path.exists():
        if resume:
            raise ValueError(f"--resume: no run dir {path} (nothing to resume)")
        return False
    if not path.is_dir():
        raise ValueError(f"run dir {path} exists and is not a directory")
    return True


def _take_lock(fh, path: Path, mode: int) -> None:
    """``flock`` the open lock file ``fh`` in ``mode`` without waiting; ValueError naming the holder's pid when
    another run holds it."""
    try:
        fcntl.flock(fh, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "?"
        raise ValueError(f"run dir {path} is in use by another run (pid {holder}); "
                         "choose another run.name") from None


def _resumable(path: Path, cfg: MegaflowConfig, *, resume: bool) -> tuple[int, Path] | None:
    """(iteration, checkpoint dir) to resume from, None to start fresh; ValueError when neither is allowed."""
    found = list_checkpoints(path)
    if not found:
        if resume:
            raise ValueError(f"--resume: {path} has no checkpoint to resume from")
        return None  # a run that never saved: start over
    last_it, last_dir = found[-1]
    if not resume:
        raise ValueError(f"run dir {path} holds a run with checkpoints (last: iteration {last_it}); "
                         "pass --resume to continue it, or choose another run.name")
    if last_it >= cfg.train.iterations:
        raise ValueError(f"--resume: {path} already finished (iteration {last_it} of "
                         f"train.iterations = {cfg.train.iterations}); raise train.iterations to continue it")
    saved = path / "config.toml"
    if saved.is_file():
        _check_same_run(cfg, saved)
    return last_it, last_dir


def _check_same_run(cfg: MegaflowConfig, saved: Path) -> None:
    old = tomllib.loads(saved.read_text())
    new = tomllib.loads(dump_config(cfg))
    for section, values in new.items():
        if section in _RESUMABLE_SECTIONS:
            continue
        for key, value in values.items():
            before = old.get(section, {}).get(key, value)
            if before != value and (section, key) not in _RESUMABLE_CHANGES:
                raise ValueError(f"--resume: {section}.{key} = {value!r} differs from the checkpointed run's "
                                 f"{before!r} ({saved}); resume with the same config")
