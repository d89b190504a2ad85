"""Ctrl-C / SIGTERM during a run: the first signal asks the run to stop after the current iteration (its
checkpoint is saved and the engines shut down, then :class:`Interrupted` is raised); a repeat within
``DUPLICATE_S`` seconds counts as the same request (Ctrl-C reaches torchrun's workers twice: from the
terminal and forwarded by torchrun). The CLI turns it into one line and exit code 130 (SIGINT) or 143
(SIGTERM); under torchrun the launcher's own exit code is its own (1 after a signal).

A second signal (later than ``DUPLICATE_S``) abandons the run, whatever it waits on (a reward that never
returns, an engine that does not answer): KeyboardInterrupt is raised in the main thread so the loop's
``finally`` shuts the engines down, and a watchdog gives that ``ABORT_GRACE_S`` seconds; then (or at once on
a third signal) :func:`abort` terminates every child process of this process by PID (the engine workers and
whatever they started; SIGKILL after ``KILL_GRACE_S``) and leaves with ``os._exit(128 + signal)``, so no
thread left running (an abandoned reward call, a pool worker) can keep the process alive and no engine
worker outlives it. From then on the handlers stay in place (``restore`` keeps them).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

DUPLICATE_S = 2.0
ABORT_GRACE_S = 5.0  # after the second signal: the time the main thread gets to shut the engines down
KILL_GRACE_S = 3.0  # abort: SIGTERM to our children, SIGKILL to those still alive this much later


class Interrupted(RuntimeError):
    def __init__(self, signum: int, iteration: int, checkpoint: str | None):
        self.signum, self.iteration, self.checkpoint = signum, iteration, checkpoint
        saved = f"checkpoint {checkpoint}; continue with --resume" if checkpoint else "no checkpoint written"
        super().__init__(f"stopped by {signal.Signals(signum).name} after iteration {iteration} ({saved})")


def kill_children(grace_s: float = KILL_GRACE_S) -> list[int]:
    """SIGTERM every descendant of this process (by PID: only our own), SIGKILL those still alive after
    ``grace_s``; the PIDs signalled."""
    import psutil
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    for child in children:
        try:
            child.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for child in alive:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=grace_s)
    return [c.pid for c in children]


def abort(signum: int, why: str) -> None:
    """Leave now: our child processes stopped (:func:`kill_children`), then ``os._exit(128 + signum)`` (no
    thread is waited for, no ``finally`` runs)."""
    try:
        print(f"\n[megaflow] {signal.Signals(signum).name}: {why}: stopping the engine workers and exiting",
              file=sys.stderr, flush=True)
        kill_children()
    finally:
        os._exit(128 + signum)


class StopRequests:
    """Installs the handlers (main thread only; elsewhere it never requests a stop)."""

    def __init__(self):
        self.signum, self._first, self.abandoned = 0, 0.0, 0
        self._saved: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._saved[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum:
            if time.monotonic() - self._first < DUPLICATE_S:
                return  # the same stop again: a launcher (torchrun) passes a terminal's Ctrl-C on to its workers
            self._abandon(signum)
            raise KeyboardInterrupt  # second signal: abandon now
        self.signum, self._first = signum, time.monotonic()
        print(f"\n[megaflow] {signal.Signals(signum).name}: stopping after this iteration (again to abandon)",
              flush=True)

    def _abandon(self, signum: int) -> None:
        """Second signal: a further one aborts at once; the watchdog aborts after ABORT_GRACE_S whatever the
        main thread is doing (a daemon thread: it also runs while the interpreter waits for other threads)."""
        self.abandoned = signum
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, _abort_now)
        print(f"\n[megaflow] {signal.Signals(signum).name} again: abandoning the run (exit within "
              f"{ABORT_GRACE_S + 2 * KILL_GRACE_S:g} s; again to exit now)", file=sys.stderr, flush=True)
        watchdog = threading.Thread(target=_abort_later, args=(signum, ABORT_GRACE_S), name="megaflow-abort",
                                    daemon=True)
        watchdog.start()

    def agreed(self) -> int:
        """The signal every rank agrees to stop for (0 = go on): any rank's request stops them all at the
        same iteration boundary (an all-reduce, so ranks never disagree on when to save and exit)."""
        import torch
        import torch.distributed as dist
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.signum
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def restore(self) -> None:
        """The handlers from before; after a second signal the abort handlers stay (a third signal must still
        end the process at once, and a default SIGTERM would leave the engine workers behind)."""
        if not self.abandoned:
            for s, handler in self._saved.items():
                signal.signal(s, handler)
        self._saved.clear()


def _abort_now(signum, frame) -> None:
    abort(signum, "signalled again")


def _abort_later(signum: int, after_s: float) -> None:
    time.sleep(after_s)
    abort(signum, f"still running {after_s:g} s after the run was abandoned")
