"""Run a function on N local processes (one per rank) and collect each rank's return value.
Design notes: docs/design/testing.md.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from megaflow._env import has_libcuda

# Imported by the forkserver before it forks ranks (megaflow first: it installs import guards).
_PRELOAD = ["megaflow", "torch", "torch.distributed", "megatron.core.parallel_state"]
_SETTLE_GRACE_S = 5.0  # after a failure / after all reported: then kill what is left


class RankError(RuntimeError):
    """A rank raised; the message carries that rank's traceback."""

    def __init__(self, rank: int, tb: str):
        super().__init__(f"rank {rank} failed:\n{tb}")
        self.rank = rank
        self.remote_traceback = tb


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable, args: tuple, env: dict[str, str], out_path: str) -> None:
    """Rank entry: own process group, torchrun-like env, run fn, pickle ('ok', value) / ('err', tb)."""
    os.setpgrp()
    os.environ.update(env)
    try:
        import torch

        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        payload = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        payload = ("err", traceback.format_exc())
    try:
        data = pickle.dumps(payload)
    except Exception:  # noqa: BLE001 - an unpicklable return value is a failure of this rank
        data = pickle.dumps(("err", "return value is not picklable:\n" + traceback.format_exc()))
    tmp = out_path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, out_path)
    if payload[0] == "err":
        Path(out_path + ".failed").touch()
    try:  # leave quickly and quietly: don't wait on gloo/atexit teardown of a broken group
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    """Temporarily set environment variables in this process (restored afterwards)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _context(start_method: str):
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _kill(procs: list) -> None:
    """SIGKILL each rank's process group: a rank still running, and helpers a finished rank left
    behind (each rank leads its own group; the id of a group is not reused while it has members)."""
    for p in procs:
        if p.pid is None:
            continue
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            if p.is_alive():  # not yet in its own group (still starting up)
                p.kill()
    for p in procs:
        p.join(5)


def _read_result(path: Path, rank: int, exitcode: int | None) -> tuple[str, Any]:
    if not path.exists():
        return "err", f"rank {rank} exited with code {exitcode} and reported nothing (crashed or killed)"
    with open(path, "rb") as f:
        return pickle.load(f)


def run_multiprocess(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout_s: float = 120,
    env: dict[str, str] | None = None,
    start_method: str | None = None,
) -> list:
    """Run ``fn(*args)`` on ``world_size`` local ranks (gloo-ready env, ``env`` added); results by rank. Raises
    ``RankError`` for the first failed rank, ``TimeoutError`` after ``timeout_s``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if start_method is None:
        start_method = "spawn" if has_libcuda() else "forkserver"
    ctx = _context(start_method)
    port = free_port()
    base_env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    base_env.update(env or {})
    with tempfile.TemporaryDirectory(prefix="megaflow-mp-") as tmp:
        paths = [Path(tmp) / f"rank{r}.pkl" for r in range(world_size)]
        procs = []
        for rank in range(world_size):
            rank_env = dict(base_env, RANK=str(rank), LOCAL_RANK=str(rank))
            p = ctx.Process(target=_rank_main, args=(fn, args, rank_env, str(paths[rank])), daemon=False)
            # A spawned rank must see its env from its first line (e.g. CUDA_VISIBLE_DEVICES); a
            # forkserver must not (it would start with, and keep, this launch's env).
            with _environ(rank_env) if start_method == "spawn" else contextlib.nullcontext():
                p.start()
            procs.append(p)
        try:
            _wait(procs, paths, timeout_s)
        finally:
            _kill(procs)
        results = [_read_result(paths[r], r, procs[r].exitcode) for r in range(world_size)]
        failed_at = {r: t for r in range(world_size) if (t := _failure_time(paths[r])) is not None}
    failed = [r for r, (status, _) in enumerate(results) if status == "err"]
    if failed:
        # Report the rank that failed first: the others often only saw "connection closed by peer".
        first = min(failed, key=lambda r: failed_at.get(r, float("inf")))
        others = "".join(
            f"\n(rank {r} also failed: {results[r][1].strip().splitlines()[-1]})"
            for r in failed
            if r != first
        )
        raise RankError(first, results[first][1] + others)
    return [value for _, value in results]


def _wait(procs: list, paths: list[Path], timeout_s: float) -> None:
    """Wait until all ranks exit. Stop waiting (the caller kills the rest) a grace period after a
    rank failed or after every rank reported (a clean rank stuck in teardown); raise on timeout."""
    deadline = time.monotonic() + timeout_s
    settled_at: float | None = None
    while True:
        alive = [rank for rank, p in enumerate(procs) if p.is_alive()]
        if not alive:
            return
        now = time.monotonic()
        all_reported = all(path.exists() for path in paths)
        if settled_at is None and (all_reported or any(map(_failed, procs, paths))):
            settled_at = now
        if settled_at is not None and now - settled_at > _SETTLE_GRACE_S:
            return
        if now > deadline:
            if settled_at is not None:
                return
            raise TimeoutError(f"ranks {alive} still running after {timeout_s:.0f} s; killed")
        time.sleep(0.05)


def _failure_time(path: Path) -> int | None:
    """When a rank marked its failure (ns), or None."""
    marker = Path(str(path) + ".failed")
    return marker.stat().st_mtime_ns if marker.exists() else None


def _failed(p, path: Path) -> bool:
    """True when this rank has reported an error or died without reporting."""
    if Path(str(path) + ".failed").exists():
        return True
    return not p.is_alive() and not path.exists()
