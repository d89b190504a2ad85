"""Whole-loop benchmarks: two ``megaflow train`` runs differing in one setting, by images/s
(``bench hosts``, ``bench async``). Design notes: docs/design/bench.md.
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
_OPTIONAL = ("time/ahead_wait_s", "time/score_after_sample_s", "time/collect_wait_s")
"""Parts summarized when every timed row has them (the asynchronous loop's wait for the batch ahead; scoring)."""


def _run(config: str, overrides: list[str], nproc: int, iterations: int, root: Path, timeout_s: float) -> list[dict]:
    """Train under torchrun with ``nproc`` processes; the metrics rows. The launch runs in its own session and
    is stopped as a whole (its process group) if it exceeds ``timeout_s``."""
    sets = [*overrides, f"train.iterations={iterations}", f'run.output_dir="{root}"', "logging.sample_every=0"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(free_port()), "-m", "megaflow.cli", "train", "-c", config,
           *[a for s in sets for a in ("--set", s)]]
    log = root / "train.log"
    root.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"bench: the run in {root.name} took over {timeout_s:.0f} s") from None
    if rc != 0:
        raise RuntimeError(f"bench: the run in {root.name} exited {rc}:\n{log.read_text()[-2000:]}")
    (metrics,) = root.glob("*/metrics.jsonl")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def summarize(rows: list[dict]) -> dict:
    """Median figures over iterations 2.. of one run's metrics rows (see the module's design notes)."""
    timed = [r for r in rows if r["iteration"] >= 2]
    if not timed:
        raise ValueError("a whole-loop bench needs at least 2 iterations (the first is warm-up)")
    images = sum(v for k, v in timed[0].items() if k.startswith("rollout/host") and k.endswith("/images"))
    parts = [*_PARTS, *(k for k in _OPTIONAL if all(k in r for r in timed))]
    out = {k.replace("/", "_"): statistics.median(r[k] for r in timed) for k in parts}
    out.update(images_per_iteration=images, iterations_timed=len(timed),
               images_per_s=images / out["time_iteration_s"],
               hosts=int(timed[0]["sync/hosts"]), syncs_verified=all(r["sync/verified"] == 1.0 for r in rows))
    return out


def compare(config: str, overrides: list[str], sides: dict[str, tuple[int, list[str]]], *, iterations: int,
            timeout_s: float) -> dict:
    """Each side (name -> (processes, its own --set overrides)) run and summarized, in order; ``ratio``: images/s
    of the second side / the first."""
    t0 = time.perf_counter()
    out = {}
    with tempfile.TemporaryDirectory(prefix="megaflow-bench-loop-") as tmp:
        for name, (nproc, extra) in sides.items():
            out[name] = summarize(_run(config, [*overrides, *extra], nproc, iterations, Path(tmp) / name, timeout_s))
    first, second = out.values()
    return {**out, "ratio": second["images_per_s"] / first["images_per_s"], "config": config,
            "overrides": list(overrides), "wall_s": time.perf_counter() - t0}


def bench_hosts(config: str, overrides: list[str], *, iterations: int = 6, timeout_s: float = 900) -> dict:
    """1 and 2 engine hosts and their ratio, as one JSON-able dict."""
    hosts = ['rollout.engine_hosts="rank"']
    return {**compare(config, overrides, {"one_host": (1, hosts), "two_hosts": (2, hosts)}, iterations=iterations,
                      timeout_s=timeout_s), "target_ratio": 1.6}


def bench_async(config: str, overrides: list[str], *, iterations: int = 12, timeout_s: float = 1800) -> dict:
    """``train.max_staleness`` 0 and 1 and their ratio, as one JSON-able dict; ``staleness``: the asynchronous
    side's median ``rollout/staleness`` over the timed iterations."""
    out = compare(config, overrides, {"synchronous": (1, ["train.max_staleness=0"]),
                                      "asynchronous": (1, ["train.max_staleness=1"])},
                  iterations=iterations, timeout_s=timeout_s)
    return {**out, "target_ratio": 1.6, "overlap": overlap(out["synchronous"], out["asynchronous"], out["ratio"]),
            "load_after": [round(x, 2) for x in os.getloadavg()]}


def overlap(sync: dict, ahead: dict, achieved: float) -> dict:
    """The asynchronous loop against perfect overlap of the synchronous run's phases: ``ideal_ratio`` =
    (rollout + train) / max(rollout, train), ``achieved_ratio`` (images/s, asynchronous / synchronous), their
    quotient, and where an asynchronous iteration's time goes beyond its ideal (medians, seconds): the trainer
    waiting for the batch ahead (``trainer_idle_s``), the engines not sampling (``engine_idle_s``: iteration less
    sampling), the sync (both wait), scoring after the last sample (``rewards_s``), and each phase's slowdown
    from sharing the cores (``contention_train_s``, ``contention_sample_s``: asynchronous less synchronous)."""
    rollout, train = sync["time_rollout_s"], sync["time_train_s"]
    ideal = (rollout + train) / max(rollout, train)
    ideal_iteration = sync["time_iteration_s"] / ideal
    return {"ideal_ratio": ideal, "achieved_ratio": achieved, "achieved_over_ideal": achieved / ideal,
            "ideal_iteration_s": ideal_iteration, "asynchronous_iteration_s": ahead["time_iteration_s"],
            "beyond_ideal_s": ahead["time_iteration_s"] - ideal_iteration,
            "trainer_idle_s": ahead.get("time_ahead_wait_s", 0.0) + ahead["time_rollout_s"],
            "engine_idle_s": max(ahead["time_iteration_s"] - ahead["time_sample_s"], 0.0),
            "sync_s": ahead["sync_seconds"], "rewards_s": ahead.get("time_score_after_sample_s", 0.0),
            "contention_train_s": ahead["time_train_s"] - train,
            "contention_sample_s": ahead["time_sample_s"] - sync["time_sample_s"]}
