"""scripts/launch.sh with NNODES=2, run as two launches on this host (NODE_RANK 0 and 1, NPROC=1 each):
the CPU demo trains with rollout.engine_hosts = "node", i.e. one engine on each "node".
Needs: CPU, 2 torchrun launches with 1 trainer rank and 1 SGLang engine each; ~1.5 min per bridge mode.

Asserted from the run's metrics.jsonl and logs: every iteration's groups were sampled on both hosts
(rollout/host0 and rollout/host1 images > 0, summing to the batch), every sync (the initial one and one
per iteration) verified on both hosts, both engines wrote their logs, the reward is finite. No process
started by the launches outlives the test (their descendants are recorded while they run and checked,
then stopped by PID if any were left)."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megaflow.testing.dist import free_port

REPO = Path(__file__).resolve().parents[1]
ITERATIONS = 2


def _descendants(procs: list[subprocess.Popen], seen: dict) -> None:
    for p in procs:
        try:
            for c in psutil.Process(p.pid).children(recursive=True):
                seen.setdefault((c.pid, c.create_time()), c)
        except psutil.NoSuchProcess:
            pass


def _launch_two_nodes(run_root: Path, mode: str, timeout_s: float = 540) -> list[tuple[int, str]]:
    port = free_port()
    args = ["bash", str(REPO / "scripts" / "launch.sh"), "-c", str(REPO / "configs" / "cpu_demo.toml"),
            "--set", f"train.iterations={ITERATIONS}", "--set", "rollout.engine_hosts=node",
            "--set", f"bridge.mode={mode}", "--set", f'run.output_dir="{run_root}"', "--set", "logging.sample_every=0"]
    env = {**os.environ, "NNODES": "2", "NPROC": "1", "MASTER_PORT": str(port),
           "VENV": str(Path(sys.executable).parents[1]), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    procs, seen = [], {}
    logs = [run_root / f"node{n}.log" for n in (0, 1)]
    run_root.mkdir(parents=True, exist_ok=True)
    try:
        for n in (0, 1):
            with open(logs[n], "w") as out:
                procs.append(subprocess.Popen(args, env={**env, "NODE_RANK": str(n)}, cwd=REPO, stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            _descendants(procs, seen)
            time.sleep(1.0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        time.sleep(2.0)
        left = [c for c in seen.values() if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        for c in left:
            c.kill()
    assert not left, f"processes outlived the launches: {[c.pid for c in left]}"
    return [(p.returncode, log.read_text()[-3000:]) for p, log in zip(procs, logs)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "distributed"])
def test_two_node_launch_trains_with_engines_on_both_nodes(tmp_path, mode):
    results = _launch_two_nodes(tmp_path / "runs", mode)
    for n, (rc, tail) in enumerate(results):
        assert rc == 0, f"node {n} exited {rc}:\n{tail}"
    run_dir = tmp_path / "runs" / "cpu_demo"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(ITERATIONS + 1))
    for r in rows:
        assert r["sync/verified"] == 1.0 and r["sync/hosts"] == 2.0 and r["sync/hosts_verified"] == 2.0, r
    batch = 4 * 4  # cpu_demo: prompts_per_iter x group_size
    for r in rows[1:]:
        assert r["rollout/host0/images"] > 0 and r["rollout/host1/images"] > 0, r
        assert r["rollout/host0/images"] + r["rollout/host1/images"] == batch
        assert math.isfinite(r["reward/total"])
    for engine in ("engine0", "engine1"):
        assert (run_dir / "logs" / f"{engine}.log").stat().st_size > 0
