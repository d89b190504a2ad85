"""``megaflow bench hosts``: whole-loop images/s of the FlowGRPO loop with 1 and with 2 engine hosts.

Each side is one real ``megaflow train`` run under torchrun (``torch.distributed.run``) on this machine:
N processes with ``rollout.engine_hosts = "rank"``, so N = 1 is today's single host and N = 2 puts one
trainer rank and ``rollout.num_engines`` engines on each of two hosts (groups split over them, training
data-parallel over both ranks, every sync verified on both). The runs read the same config (``-c`` /
``--set``), the same seeds and the same prompts. Figures per side, from the run's metrics.jsonl: the
median over iterations 2.. (the first is warm-up) of ``time/iteration_s`` (generate + score + train +
sync), and of its parts; images/s = images per iteration / median iteration time. ``ratio`` =
images/s with 2 hosts / with 1. The sides run one after the other, so load from other processes on a
shared machine affects them unequally; repeat the bench for a spread.

    megaflow bench hosts -c configs/cpu_demo.toml --set rollout.prompts_per_iter=8 --json
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megaflow.testing.dist import free_port

_PARTS = ("time/iteration_s", "time/rollout_s", "time/sample_s", "time/train_s", "sync/seconds")


def _run(config: str, overrides: list[str], nproc: int, iterations: int, root: Path, timeout_s: float) -> list[dict]:
    """Train under torchrun with ``nproc`` processes; the metrics rows. The launch runs in its own session and
    is stopped as a whole (its process group) if it exceeds ``timeout_s``."""
    sets = [*overrides, f"train.iterations={iterations}", 'rollout.engine_hosts="rank"', f'run.output_dir="{root}"',
            "logging.sample_every=0"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), "-m", "megaflow.cli", "train", "-c", config,
           *[a for s in sets for a in ("--set", s)]]
    log = root / f"hosts{nproc}.log"
    root.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"bench hosts: the {nproc}-process run took over {timeout_s:.0f} s") from None
    if rc != 0:
        raise RuntimeError(f"bench hosts: the {nproc}-process run exited {rc}:\n{log.read_text()[-2000:]}")
    (metrics,) = root.glob("*/metrics.jsonl")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def summarize(rows: list[dict]) -> dict:
    """Median figures over iterations 2.. of one run's metrics rows (see the module docstring)."""
    timed = [r for r in rows if r["iteration"] >= 2]
    if not timed:
        raise ValueError("bench hosts needs at least 2 iterations (the first is warm-up)")
    images = sum(v for k, v in timed[0].items() if k.startswith("rollout/host") and k.endswith("/images"))
    out = {k.replace("/", "_"): statistics.median(r[k] for r in timed) for k in _PARTS}
    out.update(images_per_iteration=images, iterations_timed=len(timed),
               images_per_s=images / out["time_iteration_s"],
               hosts=int(timed[0]["sync/hosts"]), syncs_verified=all(r["sync/verified"] == 1.0 for r in rows))
    return out


def bench_hosts(config: str, overrides: list[str], *, iterations: int = 6, timeout_s: float = 900) -> dict:
    """Both sides (1 and 2 engine hosts) and their ratio, as one JSON-able dict."""
    t0 = time.perf_counter()
    sides = {}
    with tempfile.TemporaryDirectory(prefix="megaflow-bench-hosts-") as tmp:
        for n in (1, 2):
            sides[n] = summarize(_run(config, overrides, n, iterations, Path(tmp) / f"hosts{n}", timeout_s))
    return {"one_host": sides[1], "two_hosts": sides[2],
            "ratio": sides[2]["images_per_s"] / sides[1]["images_per_s"], "target_ratio": 1.6,
            "config": config, "overrides": list(overrides), "wall_s": time.perf_counter() - t0}
