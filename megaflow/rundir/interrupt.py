"""Ctrl-C / SIGTERM during a run: the first signal stops the run after the current iteration (checkpoint, engines
shut down, :class:`Interrupted`); a repeat within ``DUPLICATE_S`` counts as the same request. The CLI exits 130
(SIGINT) or 143 (SIGTERM).

Design notes: docs/design/rundir.md.
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


def child_pids() -> set[int]:
    """The PIDs of this process's descendants now."""
    import psutil
    try:
        return {c.pid for c in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def resource_tracker_pid() -> int | None:
    """The PID of this process's multiprocessing resource tracker (None: none); it must end by itself, after
    unlinking the shared memory it tracks."""
    from multiprocessing import resource_tracker
    return getattr(resource_tracker._resource_tracker, "_pid", None)  # CPython's one tracker per process


def kill_children(grace_s: float = KILL_GRACE_S, *, spare: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """SIGTERM every descendant of this process but ``spare`` and the resource tracker, SIGKILL those alive after
    ``grace_s``; returns the PIDs signalled."""
    import psutil
    spare = {*spare, resource_tracker_pid()}
    try:
        children = [c for c in psutil.Process().children(recursive=True) if c.pid not in spare]
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


LEFTOVER_GRACE_S = 5.0  # how long a command's exit waits for threads it left running before it leaves without them
_PR_SET_CHILD_SUBREAPER = 36  # prctl(2), Linux


def adopt_orphans() -> bool:
    """Make this process the subreaper of its descendants (Linux ``prctl``): a grandchild whose parent exits (a
    double fork, a daemonising helper a reward starts) is re-parented here, not to init, so
    :func:`kill_children` still finds and ends it. False where the OS does not offer it."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def lingering_threads(grace_s: float = LEFTOVER_GRACE_S) -> list[threading.Thread]:
    """The non-daemon threads still alive after waiting up to ``grace_s`` for them (Python's exit would wait for
    them forever); idle ``concurrent.futures`` workers are not counted (Python's exit stops them itself)."""
    pools = getattr(sys.modules.get("concurrent.futures.thread"), "_threads_queues", {})
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon
              and t not in pools]
    deadline = time.monotonic() + grace_s
    for t in others:
        t.join(max(0.0, deadline - time.monotonic()))
    return [t for t in others if t.is_alive()]


def exit_without(threads: list[threading.Thread], code: int) -> None:
    """Leave now with ``code`` though ``threads`` still run: one stderr line naming them, stdout / stderr flushed,
    the ``atexit`` handlers run, then ``os._exit`` (so nothing waits for them)."""
    import atexit
    names = ", ".join(repr(t.name) for t in threads[:4]) + (" ..." if len(threads) > 4 else "")
    print(f"megaflow: {len(threads)} thread{'s' if len(threads) > 1 else ''} ({names}) still running after the "
          f"command (a reward's?): not waited for", file=sys.stderr)
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def abort(signum: int, why: str) -> None:
    """Leave now: our child processes stopped (:func:`kill_children`), then ``os._exit(128 + signum)`` (no
    thread is waited for, no ``finally`` runs)."""
    try:
        print(f"\n[megaflow] {signal.Signals(signum).name}: {why}: stopping the engine workers and exiting",
              file=sys.stderr, flush=True)
        kill_children()
    finally:
        os._exit(128 + signum)


_WAKEUP_FDS: set[int] = set()  # the write ends SignalWatch made the wakeup fd


def _forget_wakeup_fd() -> None:
    """In a forked child: its signals must not reach the parent's SignalWatch through the inherited pipe."""
    try:
        fd = signal.set_wakeup_fd(-1)
        if fd != -1 and fd not in _WAKEUP_FDS:
            signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
    except ValueError:  # forked from a thread the child does not count as its main thread
        pass


os.register_at_fork(after_in_child=_forget_wakeup_fd)


class SignalWatch:
    """Sees SIGINT/SIGTERM on a daemon thread reading the wakeup fd, even while the main thread is blocked in C;
    ``on_second(signum)`` for the first signal later than ``DUPLICATE_S``. Inactive when a wakeup fd is already set."""

    def __init__(self, on_second):
        self.on_second, self.active = on_second, False
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        previous = signal.set_wakeup_fd(-1)
        if previous != -1:  # not ours to replace: put it back
            signal.set_wakeup_fd(previous, warn_on_full_buffer=False)
            self._close_fds()
            return
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        _WAKEUP_FDS.add(self._write_fd)
        self.active = True
        threading.Thread(target=self._read, name="megaflow-signals", daemon=True).start()

    def _read(self) -> None:
        first = 0.0
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            if not data:  # close(): the write end is gone
                os.close(self._read_fd)
                return
            for signum in data:
                if signum not in (signal.SIGINT, signal.SIGTERM):
                    continue
                now = time.monotonic()
                if not first:
                    first = now
                elif now - first >= DUPLICATE_S:
                    self.on_second(signum)

    def close(self) -> None:
        """Stop watching (main thread): the wakeup fd unset, the thread ends."""
        if self.active:
            self.active = False
            signal.set_wakeup_fd(-1)
            _WAKEUP_FDS.discard(self._write_fd)
            os.close(self._write_fd)

    def _close_fds(self) -> None:
        os.close(self._read_fd)
        os.close(self._write_fd)


class Abandoned(KeyboardInterrupt):
    """The second signal: the run is abandoned (no checkpoint); ``signum`` says which signal (exit 128 + it)."""

    def __init__(self, signum: int):
        super().__init__(f"abandoned by {signal.Signals(signum).name}")
        self.signum = signum


class StopRequests:
    """Installs the handlers (main thread only; elsewhere it never requests a stop)."""

    def __init__(self):
        self.signum, self._first, self.abandoned = 0, 0.0, 0
        self._saved: dict[int, object] = {}
        self._armed, self._arm_lock, self._watch = False, threading.Lock(), None
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._saved[s] = signal.signal(s, self._handle)
            self._watch = SignalWatch(self._arm)

    def _handle(self, signum, frame) -> None:
        if self.signum:
            if time.monotonic() - self._first < DUPLICATE_S:
                return  # the same stop again: a launcher (torchrun) passes a terminal's Ctrl-C on to its workers
            self._abandon(signum)
            raise Abandoned(signum)  # second signal: abandon now
        self.signum, self._first = signum, time.monotonic()
        print(f"\n[megaflow] {signal.Signals(signum).name}: stopping after this iteration (again to abandon)",
              flush=True)

    def _abandon(self, signum: int) -> None:
        """Second signal: a further one aborts at once; the watchdog aborts after ABORT_GRACE_S whatever the
        main thread is doing (a daemon thread: it also runs while the interpreter waits for other threads)."""
        self.abandoned = signum
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, _abort_now)
        self._arm(signum)

    def _arm(self, signum: int) -> None:
        """Start the watchdog (once; from the handler or the SignalWatch thread, whichever sees it first)."""
        with self._arm_lock:
            if self._armed:
                return
            self._armed = True
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
        if self.abandoned or self._armed:
            self._saved.clear()
            return
        for s, handler in self._saved.items():
            signal.signal(s, handler)
        self._saved.clear()
        if self._watch is not None:
            self._watch.close()
            self._watch = None


def _abort_now(signum, frame) -> None:
    abort(signum, "signalled again")


def _abort_later(signum: int, after_s: float) -> None:
    time.sleep(after_s)
    abort(signum, f"still running {after_s:g} s after the run was abandoned")
