"""scripts/launch.sh with NNODES=2, run as two launches on this host (NODE_RANK 0 and 1, NPROC=1 each).
Engines beside the trainers (per bridge mode: shared_memory, distributed): the CPU demo trains with
rollout.engine_hosts = "node", i.e. one engine on each "node" beside its trainer rank. Disaggregated: node 0 only
trains, node 1 only samples (rollout.placement = "disaggregated", rollout.engine_ranks = 1, the distributed bridge).
Needs: CPU, 2 torchrun launches with 1 process each; ~1.5 min per case.

Asserted from the run's metrics.jsonl and logs: every iteration's groups were sampled on the engine hosts
(colocated: both, rollout/host0 and rollout/host1 images > 0, summing to the batch; disaggregated: all on
host 1), every sync (the initial one and one per iteration) verified on every engine host, every engine
wrote its log, the reward is finite. No process
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

REPO = Path(__file__).resolve().parents[2]
ITERATIONS = 2


def _descendants(procs: list[subprocess.Popen], seen: dict) -> None:
    for p in procs:
        try:
            for c in psutil.Process(p.pid).children(recursive=True):
                seen.setdefault((c.pid, c.create_time()), c)
        except psutil.NoSuchProcess:
            pass


PLACEMENTS = {  # case -> --set overrides
    "shared_memory": ["rollout.engine_hosts=node", "bridge.mode=shared_memory"],
    "distributed": ["rollout.engine_hosts=node", "bridge.mode=distributed"],
    "disaggregated": ["rollout.placement=disaggregated", "rollout.engine_ranks=1", "bridge.mode=distributed"],
}


def _launch_two_nodes(run_root: Path, case: str, timeout_s: float = 540) -> list[tuple[int, str]]:
    port = free_port()
    overrides = [a for o in PLACEMENTS[case] for a in ("--set", o)]
    args = ["bash", str(REPO / "scripts" / "launch.sh"), "-c", str(REPO / "configs" / "cpu_demo.toml"),
            "--set", f"train.iterations={ITERATIONS}", *overrides,
            "--set", f'run.output_dir="{run_root}"', "--set", "logging.sample_every=0"]
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
@pytest.mark.dist
@pytest.mark.engine
@pytest.mark.parametrize("case", list(PLACEMENTS))
def test_two_node_launch_trains_with_engines_on_the_engine_nodes(tmp_path, case):
    results = _launch_two_nodes(tmp_path / "runs", case)
    for n, (rc, tail) in enumerate(results):
        assert rc == 0, f"node {n} exited {rc}:\n{tail}"
    run_dir = tmp_path / "runs" / "cpu_demo"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(ITERATIONS + 1))
    hosts = [1] if case == "disaggregated" else [0, 1]
    for r in rows:
        assert r["sync/verified"] == 1.0 and r["sync/hosts"] == len(hosts) == r["sync/hosts_verified"], r
    batch = 4 * 4  # cpu_demo: prompts_per_iter x group_size
    for r in rows[1:]:
        assert all(r[f"rollout/host{h}/images"] > 0 for h in hosts), r
        assert sum(r.get(f"rollout/host{h}/images", 0.0) for h in (0, 1)) == batch, r
        assert math.isfinite(r["reward/total"])
    for engine in [f"engine{i}" for i in range(len(hosts))]:
        assert (run_dir / "logs" / f"{engine}.log").stat().st_size > 0
