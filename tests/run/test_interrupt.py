"""StopRequests: the first signal asks for a stop, a repeat within DUPLICATE_S is the same request (torchrun
passes a terminal's Ctrl-C on to workers that already got it), a later one abandons (KeyboardInterrupt) and
arms the abort: after ABORT_GRACE_S, or at once on a third signal, ``abort`` (children killed, os._exit).
``abort`` is replaced by a recorder here; tests/run/test_abort.py runs the real one. Needs: CPU, 1 process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from megaflow.rundir import interrupt


def test_repeat_within_the_window_is_the_same_stop_and_a_later_one_abandons(monkeypatch):
    aborts: list[tuple[int, str]] = []
    monkeypatch.setattr(interrupt, "abort", lambda signum, why: aborts.append((signum, why)))
    monkeypatch.setattr(interrupt, "ABORT_GRACE_S", 0.3)
    stop = interrupt.StopRequests()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the launcher's copy: still one request
        assert stop.signum == signal.SIGINT and stop.agreed() == signal.SIGINT
        monkeypatch.setattr(interrupt, "DUPLICATE_S", 0.0)
        with pytest.raises(KeyboardInterrupt) as abandoned:
            os.kill(os.getpid(), signal.SIGTERM)
        assert isinstance(abandoned.value, interrupt.Abandoned) and abandoned.value.signum == signal.SIGTERM
        assert stop.abandoned == signal.SIGTERM and not aborts
        stop.restore()  # as the loop's finally does: the abort handlers stay
        assert signal.getsignal(signal.SIGTERM) is interrupt._abort_now
        os.kill(os.getpid(), signal.SIGINT)  # a third signal: abort at once
        assert aborts == [(signal.SIGINT, "signalled again")]
        deadline = time.monotonic() + 10
        while len(aborts) < 2 and time.monotonic() < deadline:  # the watchdog, ABORT_GRACE_S after the second
            time.sleep(0.05)
        assert aborts[1][0] == signal.SIGTERM and "abandoned" in aborts[1][1]
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_restore_after_a_plain_stop_gives_back_the_handlers():
    stop = interrupt.StopRequests()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signum == signal.SIGTERM and not stop.abandoned
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_abort_kills_our_children_and_exits_with_the_signal_code():
    """A process with a child that ignores SIGTERM: abort SIGKILLs it after KILL_GRACE_S and exits 143."""
    code = ("import signal, subprocess, sys, time\n"
            "from megaflow.rundir import interrupt\n"
            "interrupt.KILL_GRACE_S = 0.5\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(60)'], "
            "stdout=subprocess.PIPE)\n"
            "child.stdout.readline()\n"
            "print(child.pid, flush=True)\n"
            "interrupt.abort(signal.SIGTERM, 'test')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    child = int(proc.stdout.split()[0])
    assert "stopping the engine workers" in proc.stderr
    assert not _alive(child)


def test_kill_children_spares_the_resource_tracker_which_ends_with_us():
    """The command's last kill_children (a process that used shared memory has a resource tracker, which ignores
    SIGTERM): the other child is stopped at once, with no grace waited out; the tracker lives until its process
    ends, then ends by itself."""
    code = ("import subprocess, sys, time\n"
            "from multiprocessing import resource_tracker\n"
            "from megaflow.rundir import interrupt\n"
            "resource_tracker.ensure_running()\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "t0 = time.monotonic()\n"
            "killed = interrupt.kill_children(grace_s=30)\n"
            "print(time.monotonic() - t0, child.pid, interrupt.resource_tracker_pid(), killed, flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seconds, child, tracker, killed = proc.stdout.split(" ", 3)
    assert killed.strip() == f"[{child}]" and float(seconds) < 10  # the tracker spared, no grace waited out
    deadline = time.monotonic() + 30
    while _alive(int(tracker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(int(tracker))


def test_a_main_thread_blocked_in_c_is_still_aborted_by_the_second_signal():
    """The main thread waits on a lock with SIGTERM blocked, so the signals go to another thread and the Python
    handlers never run (as when it waits inside a collective): the wakeup-fd watch arms the watchdog."""
    code = ("import signal, sys, threading, time\n"
            "from megaflow.rundir import interrupt\n"
            "interrupt.DUPLICATE_S, interrupt.ABORT_GRACE_S = 0.2, 0.5\n"
            "stop = interrupt.StopRequests()\n"
            "threading.Thread(target=time.sleep, args=(120,), daemon=True).start()  # takes the signals\n"
            "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
            "print('ready', flush=True)\n"
            "lock = threading.Lock()\nlock.acquire()\nlock.acquire()  # blocks in C for ever\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert proc.poll() is None  # the first signal only asks for a stop
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "abandoning the run" in err and "after the run was abandoned" in err, err


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
