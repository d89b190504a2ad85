"""Ownership of a run directory (``<run.output_dir>/<run.name>``), taken by rank 0 before any work.
Design notes: docs/design/rundir.md.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import tomllib
from pathlib import Path

from megaflow.config import MegaflowConfig, dump_config, run_dir_of
from megaflow.config.files import CKPT_META
from megaflow.config.load import MAX_CONFIG_BYTES, current_values
from megaflow.config.resume_changes import Change, config_changes, refused_change
from megaflow.rundir.checkpoints import MODEL_DIR, STATE_FILE, check_resume, list_checkpoints, read_state

LOCK_FILE = ".lock"
CONFIG_FILE = "config.toml"


class RunDir:
    """The claimed run directory; ``resume_from`` is the checkpoint dir to continue from (or None), ``changes``
    what the resumed run's config changed (accepted: config/resume_changes.py, or named in ``overrides``)."""

    def __init__(self, cfg: MegaflowConfig, *, resume: bool, overrides: tuple[str, ...] = ()):
        self.path = run_dir_of(cfg)
        self.created = False
        self.resume_from: Path | None = None
        self.resume_iteration = 0
        self.changes: list[Change] = []
        self._lock_fh = None
        self._undo = True  # until the first iteration is done a failure puts back what the claim found
        with _os_errors(self.path):
            if not _check_path(self.path, resume=resume):
                self.path.mkdir(parents=True)
                self.created = True
            self._made_lock = not os.path.lexists(self.path / LOCK_FILE)
            self._config_before = _read_bytes(self.path / CONFIG_FILE)
        try:
            with _os_errors(self.path):
                self._lock()
        except BaseException:
            if self.created:
                shutil.rmtree(self.path, ignore_errors=True)
            raise
        try:
            with _os_errors(self.path):
                self._check_history(cfg, resume=resume, overrides=overrides)
                self._write_pid()
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
        self._lock_fh = fh

    def _write_pid(self) -> None:
        fh = self._lock_fh
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()

    def _check_history(self, cfg: MegaflowConfig, *, resume: bool, overrides: tuple[str, ...]) -> None:
        found = _resumable(self.path, cfg, resume=resume, overrides=overrides)
        if found is not None:
            self.resume_iteration, self.resume_from, self.changes = found

    def release(self, *, failed: bool) -> None:
        """Unlock; a run that ``failed`` before its first iteration removes the dir it created, or else puts
        back the ``config.toml`` it found and removes the lock file it made."""
        if failed and self._undo and not self.created:
            _put_back(self.path / CONFIG_FILE, self._config_before)
            if self._made_lock:
                with contextlib.suppress(OSError):
                    os.unlink(self.path / LOCK_FILE)
        if self._lock_fh is not None:
            self._lock_fh.close()
            self._lock_fh = None
        if failed and self.created and not list_checkpoints(self.path):
            shutil.rmtree(self.path, ignore_errors=True)

    def first_iteration_done(self) -> None:
        """From now on a failure keeps the dir (its metrics and checkpoints are the run's record)."""
        self.created = False
        self._undo = False


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


def check_run_dir(cfg: MegaflowConfig, *, resume: bool, overrides: tuple[str, ...] = ()) -> None:
    """The claim's checks without taking it (nothing created or locked): the CLI runs this before any
    heavy import so a refused run dir is one line at once; :class:`RunDir` makes the same checks under the lock."""
    path = run_dir_of(cfg)
    with _os_errors(path):
        if not _check_path(path, resume=resume):
            return
        _read_bytes(path / CONFIG_FILE)  # what the claim keeps to put back: a regular file, or none
        lock = path / LOCK_FILE
        if lock.is_file():
            with open(lock) as fh:
                _take_lock(fh, path, fcntl.LOCK_SH)
        _resumable(path, cfg, resume=resume, overrides=overrides)


@contextlib.contextmanager
def _os_errors(path: Path):
    """An OSError inside becomes one ValueError line naming the file and the OS's reason."""
    try:
        yield
    except OSError as e:
        where = "" if e.filename in (None, str(path)) else f"{str(e.filename)!r}: "
        raise ValueError(f"run dir {str(path)!r}: {where}{_reason(e)}") from None


def _reason(e: OSError) -> str:
    text = e.strerror or type(e).__name__
    return text[:1].lower() + text[1:]


def _check_path(path: Path, *, resume: bool) -> bool:
    """Whether the run dir exists; ValueError when it is not a directory (or a symlink out of
    ``run.output_dir``, or a dangling one), when ``run.output_dir`` cannot hold it, or ``resume`` finds none."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except NotADirectoryError:  # run.output_dir, or a folder above it, is a file
        mode = None
    except OSError as e:
        raise ValueError(f"run dir {str(path)!r}: {_reason(e)}") from None
    if mode is None:
        if resume:
            raise ValueError(f"--resume: no run dir {path} (nothing to resume)")
        _check_creatable(path)
        return False
    if stat.S_ISLNK(mode):
        _check_link(path)
    if not path.is_dir():
        raise ValueError(f"run dir {path} exists and is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"run dir {str(path)!r}: not writable (permission denied)")
    return True


def _check_link(path: Path) -> None:
    """A symlinked run dir must lead to a directory in ``run.output_dir``: a run writes nowhere else."""
    target = os.readlink(path)
    if not path.exists():
        raise ValueError(f"run dir {path} is a dangling symlink (to {target!r}); remove it or choose another run.name")
    real, out = path.resolve(), path.parent.resolve()
    if real.parent != out:
        raise ValueError(f"run dir {path} is a symlink to {real}, outside run.output_dir = {str(path.parent)!r}; "
                         "a run writes only inside run.output_dir: remove the link or choose another run.name")


def _check_creatable(path: Path) -> None:
    """The run dir ``path`` can be made (with ``run.output_dir`` and its parents when missing); ValueError naming
    ``run.output_dir``, the first existing folder above it that cannot hold it, or a name too long for it."""
    out, where = path.parent, path.parent
    while not os.path.lexists(where) and where.parent != where:
        where = where.parent
    said = f"run.output_dir = {str(out)!r}: " + ("" if where == out else f"{str(where)!r} is ")
    if os.path.islink(where) and not where.exists():
        raise ValueError(f"{said}a dangling symlink (to {os.readlink(where)!r})")
    if not where.is_dir():
        raise ValueError(f"{said}not a directory")
    if not os.access(where, os.W_OK | os.X_OK):
        raise ValueError(f"{said}not writable (permission denied)")
    _check_name_lengths(path, where)


def _check_name_lengths(path: Path, where: Path) -> None:
    """The folders of ``path`` below the existing ``where`` fit the file system's name and path limits."""
    try:
        name_max, path_max = os.pathconf(where, "PC_NAME_MAX"), os.pathconf(where, "PC_PATH_MAX")
    except (OSError, ValueError):
        return
    for part in path.relative_to(where).parts:
        if len(os.fsencode(part)) > name_max:
            raise ValueError(f"run dir {str(path)!r}: file name too long ({len(os.fsencode(part))} bytes in "
                             f"{part[:16]!r}..., the limit is {name_max})")
    if len(os.fsencode(path.absolute())) >= path_max:
        raise ValueError(f"run dir {str(path)!r}: file name too long (the path is over {path_max} bytes)")


# fcntl.flock, not filelock: the refusal names the holder's pid, which the holder writes into the lock file under
# the lock (filelock neither writes nor reports a holder), and this module is read before any third-party import.
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


def _resumable(path: Path, cfg: MegaflowConfig, *, resume: bool,
               overrides: tuple[str, ...] = ()) -> tuple[int, Path, list[Change]] | None:
    """(iteration, checkpoint dir, the config's accepted changes) to resume from, None to start fresh; ValueError
    when neither is allowed."""
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
    check_resume(read_state(last_dir), last_dir, algorithm=cfg.algo.name,  # before anything starts
                 prompts_per_iter=cfg.rollout.prompts_per_iter)
    saved = path / CONFIG_FILE
    if os.path.lexists(saved):  # a directory, a FIFO or a symlink loop there: one line, from read_toml
        changes = _check_same_run(cfg, saved, overrides)
    else:  # config.toml lost: what the checkpoint itself records
        changes = _check_checkpoint(cfg, last_dir, overrides)
    return last_it, last_dir, changes


def _check_checkpoint(cfg: MegaflowConfig, ckpt: Path, overrides: tuple[str, ...]) -> list[Change]:
    """The model family and tp / pp layout the checkpoint ``ckpt`` was saved with, against ``cfg``'s (what can be
    checked without its run's ``config.toml``); their changes, each one named in ``overrides``."""
    meta, state = _read_json(ckpt / MODEL_DIR / CKPT_META), _read_json(ckpt / STATE_FILE)
    layout = state.get("layout") if isinstance(state.get("layout"), dict) else {}
    before = {"model": {"family": meta.get("family", cfg.model.family)},
              "parallel": {key: layout.get(key, getattr(cfg.parallel, key)) for key in ("tp", "pp")}}
    after = {"model": {"family": cfg.model.family}, "parallel": {key: getattr(cfg.parallel, key) for key in ("tp", "pp")}}
    changes = config_changes(before, after)
    if (refused := refused_change(changes, overrides)) is not None:
        where = ckpt / MODEL_DIR / CKPT_META if refused.key == "model.family" else ckpt / STATE_FILE
        raise ValueError(f"--resume: {refused.key} = {refused.after!r} differs from the checkpoint's "
                         f"{refused.before!r} ({where}); {_SAME_OR_OVERRIDE.format(key=refused.key)}")
    return changes


def _read_json(path: Path) -> dict:
    """A JSON object from ``path``; {} when it is absent or unreadable (the checks that need it are skipped)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_bytes(path: Path) -> bytes | None:
    """The run's saved config ``path`` as it is (None: none); ValueError when it is no regular file or is over
    the size of a run file (a FIFO or a device is never read), OSError for the OS's refusals (a symlink loop)."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_CONFIG_BYTES:
        why = "not a regular file" if not stat.S_ISREG(info.st_mode) else f"{info.st_size} bytes"
        raise ValueError(f"run dir {str(path.parent)!r}: {path.name} is {why}, not the run's saved config "
                         "(move it away)")
    return path.read_bytes()


def _put_back(path: Path, data: bytes | None) -> None:
    """``path`` as it was: ``data``, or no file when None (best effort: a failing run's cleanup)."""
    try:
        if data is None:
            if os.path.lexists(path):
                os.unlink(path)
        elif _read_bytes(path) != data:
            path.write_bytes(data)
    except OSError:
        pass


_SAME_OR_OVERRIDE = ("it changes what the run trains: resume with the same value, or pass --resume-override {key} "
                     "if you mean it")


def _check_same_run(cfg: MegaflowConfig, saved: Path, overrides: tuple[str, ...]) -> list[Change]:
    """The changes of ``cfg`` against the run's saved config; ValueError naming the first one a resume refuses
    (one line too when that file is no run file: read as ``base`` files are, each section a table)."""
    from megaflow.config.inherit import read_toml
    from megaflow.config.suggest import clipped
    old = current_values(read_toml(saved, " (the run's saved config)"))  # a run saved before a value was renamed
    for section, values in old.items():
        if not isinstance(values, dict):
            raise ValueError(f"--resume: {saved}: {clipped(section)} is not a table ({type(values).__name__}); "
                             "not the config.toml megaflow saves")
    changes = config_changes(old, tomllib.loads(dump_config(cfg)))
    if (refused := refused_change(changes, overrides)) is not None:
        raise ValueError(f"--resume: {refused.key} = {refused.after!r} differs from the checkpointed run's "
                         f"{refused.before!r} ({saved}); {_SAME_OR_OVERRIDE.format(key=refused.key)}")
    return changes
