"""A second SIGTERM abandons a run whatever it waits on: `megaflow train` whose reward never returns (and has no
time limit, reward.timeout_s = 0) gets SIGTERM once the reward is called (a stop at the iteration boundary,
which never comes), then SIGTERM again 3 s later (past DUPLICATE_S); it must exit within 20 s of the second,
with code 143, and leave none of its child processes (the SGLang engine workers) alive (its multiprocessing
resource tracker, which ends by itself, within 10 s). While it is stuck, every
TCP socket the run's processes listen on must be on loopback. The signals go to the
driver's PID only, as `kill PID` sends them: the workers are never signalled by the test.
Needs: CPU, 1 process, a real SGLang engine (~1 min, slow)."""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest
from resume_harness import assert_none_outlive, record_descendants
from reward_runs import train_with_reward

from megaflow.testing import sockets

pytestmark = [pytest.mark.slow, pytest.mark.engine]

STUCK = """
import time
from pathlib import Path

def score(images, prompts, metadata):
    Path(__file__).with_suffix(".called").touch()
    while True:  # never returns
        time.sleep(1)
"""


def test_second_sigterm_aborts_a_run_stuck_in_a_reward_and_leaves_no_children(tmp_path):
    (tmp_path / "stuckreward.py").write_text(STUCK)
    called = tmp_path / "stuckreward.called"
    cmd, env = train_with_reward(tmp_path, "stuck", "stuckreward:score", ["reward.timeout_s=0", "train.iterations=3"])
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    seen: set[int] = set()
    watch = threading.Thread(target=record_descendants, args=(proc, seen), daemon=True)
    watch.start()
    try:
        deadline = time.monotonic() + 400
        while not called.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert called.exists(), f"the reward was never called (rc {proc.poll()})"
        assert seen, "the run started no child process (no engine workers?)"
        listening = sockets.inet_listeners(sockets.tree(proc.pid))  # a live run: driver, engine workers
        assert all(sockets.is_loopback(ip) for _, ip, _ in listening), listening
        print(f"a live run listens on {len(listening)} TCP sockets, all loopback:", sorted({ip for _, ip, _ in listening}))
        proc.send_signal(signal.SIGTERM)  # first: stop at the iteration boundary, which never comes
        time.sleep(3.0)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)  # second: abandon
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=20)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    watch.join(timeout=5)
    assert proc.returncode == 128 + signal.SIGTERM, (proc.returncode, err[-3000:])
    assert took < 20, took
    assert_none_outlive(seen, within_s=10.0, detail=f"\n{err[-3000:]}")
    assert "abandoning the run" in err, err[-3000:]
