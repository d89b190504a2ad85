"""The kill -9 resume tests' harness: ``megaflow train`` launches that record their processes, the tiny run's
config, the crash-and-resume sequence and the bit-for-bit comparison of two runs (torch.equal, fp32, CPU).
Shared by test_resume.py, test_resume_async.py and test_clean_algorithms.py; its process watch by test_abort.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

from megaflow.rundir.checkpoints import list_checkpoints

REPO = Path(__file__).resolve().parents[2]
CONFIG = """
[run]
name = "{name}"
output_dir = "{out}"
num_threads = 1
[model]
family = "sd3"
[rollout]
group_size = 2
prompts_per_iter = 2
num_steps = 3
height = 32
width = 32
[reward]
weights = {{ color_target = 1.0 }}
kwargs = {{ color_target = {{ target = "red" }} }}
[algo]
clip_range = 1e-4
kl_beta = 0.0
[train]
iterations = 5
lr = 3e-3
micro_batch_size = 2
save_every = 2
keep_checkpoints = 2
"""


class Launch:
    """``megaflow train`` in a subprocess (torchrun with ``nproc`` > 1) that records every descendant pid."""

    def __init__(self, config: Path, *, nproc: int, resume: bool, fault: str = "", extra: tuple = ()):
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        env.pop("MEGAFLOW_FAULT", None)
        if fault:
            env["MEGAFLOW_FAULT"] = fault
        args = ["-m", "megaflow.cli", "train", "-c", str(config), *(["--resume"] if resume else []), *extra]
        if nproc > 1:
            # torchrun SIGKILLs its ranks 30 s after a signal by default: give a loaded machine time to checkpoint
            args = ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                    str(_free_port()), "--shutdown-timeout", "240", *args]
        self.proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.descendants: set[int] = set()
        self._watch = threading.Thread(target=record_descendants, args=(self.proc, self.descendants), daemon=True)
        self._watch.start()

    def wait(self, timeout: float = 600) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        self._watch.join()
        return self.proc.returncode, out, err

    def assert_no_orphans(self, within_s: float = 30.0) -> None:
        assert_none_outlive(self.descendants, within_s)


def record_descendants(proc: subprocess.Popen, seen: set[int]) -> None:
    """Add the pid of every descendant of ``proc`` to ``seen`` until it exits (a watcher thread's body)."""
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        try:
            seen.update(c.pid for c in root.children(recursive=True))
        except psutil.Error:
            pass
        time.sleep(0.1)


def assert_none_outlive(pids, within_s: float, detail: str = "") -> None:
    """Fail, naming their command lines (after killing them), if any of ``pids`` is still alive ``within_s`` after
    the run exited. The grace is for the multiprocessing resource tracker a run spares: it ends by itself once it
    sees the driver gone (after unlinking what it tracks), on a loaded machine a moment later; a worker left behind
    never ends."""
    deadline = time.monotonic() + within_s
    while True:
        alive = {p: _cmdline(p) for p in pids if _alive(p)}
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for p in alive:  # clean up before failing
        os.kill(p, signal.SIGKILL)
    assert not alive, f"processes outlived their run: {alive}{detail}"


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:200]
    except psutil.Error:
        return "?"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(tmp: Path, name: str, tp: int) -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(CONFIG.format(name=name, out=tmp / "runs") + f"[parallel]\ntp = {tp}\n")
    return path


def final_weights(run_dir: Path, shadow: str | None = None) -> dict[str, object]:
    """The last checkpoint's model entries (``shadow``: with that shadow's tensors in place of the trained ones),
    flattened to dotted names (tensors and extra states)."""
    from megaflow.trainer.checkpoint import load_full_state_dict
    it, ckpt = list_checkpoints(run_dir)[-1]
    assert it == 5

    def flat(x, prefix=""):
        if isinstance(x, dict):
            for k, v in x.items():
                yield from flat(v, f"{prefix}.{k}" if prefix else str(k))
        else:
            yield prefix, x
    return dict(flat(load_full_state_dict(ckpt / "model", shadow=shadow)[1]))


def _rewards(run_dir: Path) -> list[tuple[int, float | None]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["iteration"], r.get("reward/total")) for r in rows]


def _sigint_after_first_iteration(launch: Launch, run_dir: Path) -> None:
    """SIGINT the launch once iteration 1's metrics row is written (however long a loaded machine takes to get
    there: the suite's per-test timeout bounds it)."""
    while launch.proc.poll() is None:
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and any(json.loads(x).get("iteration") == 1 for x in metrics.read_text().splitlines()
                                     if x.strip()):
            os.killpg(launch.proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
            return
        time.sleep(0.05)
    raise AssertionError(f"the run ended (exit {launch.proc.returncode}) before its SIGINT was sent")


def crash_and_resume(tmp: Path, tp: int, faults: list[str], sigint_first: bool, extra: tuple = (),
                      nproc: int = 0) -> Path:
    config = write_config(tmp, "crashed", tp)
    run_dir = tmp / "runs" / "crashed"
    resume, nproc = False, nproc or tp
    if sigint_first:
        launch = Launch(config, nproc=nproc, resume=False, extra=extra)
        _sigint_after_first_iteration(launch, run_dir)
        rc, _, err = launch.wait()
        lines = [x for x in err.splitlines() if x.startswith("megaflow:")]
        # every rank stops with a checkpoint (torchrun then exits 1, having been signalled itself)
        assert rc == (130 if nproc == 1 else 1), (rc, err[-2000:])
        assert [x for x in lines if "stopped by SIGINT" in x] == lines and len(lines) == nproc, err[-2000:]
        launch.assert_no_orphans()
        resume = True
    for fault in faults:
        launch = Launch(config, nproc=nproc, resume=resume, fault=fault, extra=extra)
        rc, _, err = launch.wait()
        assert rc != 0, f"fault {fault} did not stop the run:\n{err[-2000:]}"
        launch.assert_no_orphans()
        assert list_checkpoints(run_dir), f"no usable checkpoint after fault {fault}"
        resume = True
    launch = Launch(config, nproc=nproc, resume=True, extra=extra)
    rc, out, err = launch.wait()
    assert rc == 0, err[-3000:]
    return run_dir


def reference_run(tmp: Path, tp: int, extra: tuple = ()) -> Path:
    launch = Launch(write_config(tmp, "reference", tp), nproc=tp, resume=False, extra=extra)
    rc, _, err = launch.wait()
    assert rc == 0, err[-3000:]
    return tmp / "runs" / "reference"


def assert_same_run(reference: Path, crashed: Path, shadows: tuple = ()) -> None:
    for shadow in shadows:
        ref_s, got_s = final_weights(reference, shadow), final_weights(crashed, shadow)
        assert all(torch.equal(ref_s[k], got_s[k]) for k in ref_s if isinstance(ref_s[k], torch.Tensor)), shadow
    ref_w, got_w = final_weights(reference), final_weights(crashed)
    assert ref_w.keys() == got_w.keys()
    assert sum(isinstance(v, torch.Tensor) for v in ref_w.values()) > 50
    differ = [k for k in ref_w if not (torch.equal(ref_w[k], got_w[k]) if isinstance(ref_w[k], torch.Tensor)
                                       else ref_w[k] == got_w[k])]
    assert not differ, f"{len(differ)} tensors differ after resume, e.g. {differ[:3]}"
    ref_r, got_r = _rewards(reference), _rewards(crashed)
    assert [i for i, _ in got_r] == list(range(6)), f"metrics.jsonl iterations: {[i for i, _ in got_r]}"
    assert got_r == ref_r


NFT = ("--set", "algo.name=nft", "--set", "rollout.sde_type=ode", "--set", "algo.nft_num_timesteps=2",
       "--set", "algo.old_decay_rate=0.2", "--set", "train.ema_decay=0.9", "--set", "train.warmup_iterations=2",
       "--set", "train.lr_schedule=cosine")


def measured(key: str) -> bool:
    """A time or memory measurement (the only metrics that may depend on the machine's load)."""
    leaf = key.rsplit("/", 1)[-1]
    return key.startswith(("time/", "mem/")) or leaf == "seconds" or leaf.endswith(("_s", "_seconds"))

