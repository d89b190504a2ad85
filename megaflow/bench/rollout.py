"""``megaflow bench rollout``: rollout images/s of 1..N SGLang engines (through the balancer) vs the plain
``DiffusersEngine`` loop, the same work per call. Design notes: docs/design/bench.md.
"""
from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from megaflow.rollout.balancer import Balancer
from megaflow.rollout.engine import RolloutEngine
from megaflow.rollout.types import RolloutRequest

__all__ = ["bench_rollout", "make_requests", "time_calls"]

EngineFactory = Callable[[str, str], RolloutEngine]
"""(pipeline_dir, engine_id) -> a started engine."""

_PROMPTS = ("a red circle on a white background", "a blue square", "two green triangles", "a yellow star",
            "a purple circle and an orange square", "a black triangle", "a white star on black", "a small red square")


def make_requests(*, groups: int, group_size: int, steps: int, res: int, sde_type: str = "sde",
                  seed: int = 0) -> list[RolloutRequest]:
    """``groups`` prompt groups with distinct, recorded seeds (the FlowGRPO rollout of one iteration)."""
    return [RolloutRequest(prompt=_PROMPTS[g % len(_PROMPTS)], num_outputs=group_size,
                           seeds=[seed + g * group_size + j for j in range(group_size)], num_steps=steps,
                           height=res, width=res, sde_type=sde_type, log_prob_no_const=sde_type == "cps")
            for g in range(groups)]


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _timed_call(engine: RolloutEngine, requests: Sequence[RolloutRequest]) -> tuple[float, int, dict]:
    """Seconds and images of one call, plus each per-sample timing key averaged over its trajectories."""
    t0 = time.perf_counter()
    trajs = engine.generate(requests)
    seconds = time.perf_counter() - t0
    assert all(torch.isfinite(t.log_probs).all() for t in trajs), "non-finite log-probs in a rollout"
    keys = {k for t in trajs for k in t.timings}
    timings = {k: round(sum(t.timings.get(k, 0.0) for t in trajs) / len(trajs), 4) for k in sorted(keys)}
    return seconds, len(trajs), timings


def time_calls(contenders: dict[str, RolloutEngine], requests: Sequence[RolloutRequest], *, warmup: int,
               repeats: int) -> dict[str, dict]:
    """Warm up, then time ``repeats`` interleaved rounds; images/s per contender and the last call's engine
    timings (docs/design/bench.md)."""
    for engine in contenders.values():
        for _ in range(warmup):
            engine.generate(requests)
    load_before = _load()
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    images = dict.fromkeys(contenders, 0)
    timings: dict[str, dict] = {}
    for _ in range(repeats):
        for name, engine in contenders.items():
            s, n, timings[name] = _timed_call(engine, requests)
            seconds[name].append(s)
            images[name] += n
    load = {"load_before": load_before, "load_after": _load()}
    return {name: {"images_per_s": images[name] / sum(seconds[name]),
                   "images_per_s_median": images[name] / repeats / statistics.median(seconds[name]),
                   "images_per_call": images[name] // repeats,
                   "call_seconds": [round(x, 4) for x in seconds[name]], "last_call_timings": timings[name],
                   **load} for name in contenders}


def _start_engine(factory: EngineFactory, pipeline_dir: str, engine_id: str) -> tuple[RolloutEngine, float]:
    """Start one engine in the calling thread (which must outlive it); returns it and its start seconds."""
    t0 = time.perf_counter()
    engine = factory(pipeline_dir, engine_id)
    return engine, round(time.perf_counter() - t0, 2)


def sglang_factory(**engine_kwargs) -> EngineFactory:
    """Factory for ``SGLangEngine`` (``engine_kwargs``: SGLangEngineConfig fields); ``server_kwargs`` defaults
    to ``{"sleep_on_idle": True}`` (docs/design/bench.md)."""
    from megaflow.rollout.sglang import SGLangEngine, SGLangEngineConfig

    kwargs = dict(engine_kwargs)
    kwargs["server_kwargs"] = {"sleep_on_idle": True, **kwargs.get("server_kwargs", {})}

    def make(pipeline_dir: str, engine_id: str) -> RolloutEngine:
        return SGLangEngine(SGLangEngineConfig(model_path=pipeline_dir, engine_id=engine_id, **kwargs))

    return make


def bench_rollout(pipeline_dir: str, *, engines: Sequence[int] = (1, 2), groups: int = 2, group_size: int = 8,
                  steps: int = 4, res: int = 64, sde_type: str = "sde", warmup: int = 1, repeats: int = 5,
                  seed: int = 0, baseline: bool = True, baseline_threads: int = 1,
                  engine_factory: EngineFactory | None = None, engine_kwargs: dict | None = None) -> dict:
    """Images/s per engine count in ``engines`` and for the diffusers baseline, each timed beside it; ``ratio`` =
    largest count / baseline (``ratio_median`` from median times). ``baseline_threads``: torch threads of the
    baseline and of each worker unless ``engine_kwargs`` sets ``num_threads`` (docs/design/bench.md)."""
    if not engines or any(n < 1 for n in engines):
        raise ValueError(f"engines must be a non-empty list of counts >= 1, got {list(engines)}")
    if groups < 1 or group_size < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"need groups, group_size, repeats >= 1 and warmup >= 0, got "
                         f"{groups}, {group_size}, {repeats}, {warmup}")
    torch.set_num_threads(baseline_threads)
    engine_kwargs = {"num_threads": baseline_threads, **(engine_kwargs or {})}
    factory = engine_factory or sglang_factory(**engine_kwargs)
    requests = make_requests(groups=groups, group_size=group_size, steps=steps, res=res, sde_type=sde_type,
                             seed=seed)
    result: dict = {
        "config": {"pipeline_dir": str(pipeline_dir), "groups": groups, "group_size": group_size, "steps": steps,
                   "res": res, "sde_type": sde_type, "warmup": warmup, "repeats": repeats,
                   "engine_kwargs": engine_kwargs, "baseline_threads": baseline_threads,
                   "cpu_count": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "engines": list(engines), "images_per_s": {}, "engine_start_s": {}, "runs": {}}
    base = None
    if baseline:
        from megaflow.rollout.baseline import DiffusersEngine, DiffusersEngineConfig

        t0 = time.perf_counter()
        base = DiffusersEngine.from_pretrained(str(pipeline_dir), config=DiffusersEngineConfig(engine_id="baseline"))
        result["baseline_start_s"] = round(time.perf_counter() - t0, 2)
    started: list[RolloutEngine] = []
    start_seconds: list[float] = []
    try:
        for n in sorted(engines):  # engines are added as the count grows: max(engines) starts in all
            while len(started) < n:
                engine, seconds = _start_engine(factory, str(pipeline_dir), f"sglang-{len(started)}")
                started.append(engine)
                start_seconds.append(seconds)
            balancer = Balancer(started, seed=seed)
            contenders = {"engines": balancer, **({"baseline": base} if base is not None else {})}
            runs = time_calls(contenders, requests, warmup=warmup, repeats=repeats)
            runs["engines"]["balancer"] = balancer.metrics()
            result["images_per_s"][str(n)] = round(runs["engines"]["images_per_s"], 3)
            result["engine_start_s"][str(n)] = start_seconds[:n]
            result["runs"][str(n)] = runs
    finally:
        for e in started:
            e.shutdown()
        if base is not None:
            base.shutdown()
    if base is not None:
        result.update(_ratios(result, str(max(engines))))
    return result


def _ratios(result: dict, best: str) -> dict:
    """The engines' images/s over the baseline's, each taken next to the other: for the largest engine count
    ``best`` (also from median call times, robust to load spikes from other processes) and for every count."""
    base_rate = result["runs"][best]["baseline"]["images_per_s"]
    return {"baseline_images_per_s": round(base_rate, 3),
            "ratio": round(result["images_per_s"][best] / base_rate, 3),
            "ratio_per_engine_count": {k: round(result["images_per_s"][k] / r["baseline"]["images_per_s"], 3)
                                       for k, r in result["runs"].items()},
            "ratio_median": round(result["runs"][best]["engines"]["images_per_s_median"]
                                  / result["runs"][best]["baseline"]["images_per_s_median"], 3)}
