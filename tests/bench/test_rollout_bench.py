"""``megaflow.bench.rollout`` plumbing, without SGLang. Needs: CPU, 1 process.

The engines under test are baseline ``DiffusersEngine`` loops (via ``engine_factory``) on a tiny SD3
pipeline written to a temp dir, so this checks the bench's bookkeeping (interleaved timing, per-count
results, ratios, balancer metrics, engine start-up outside the timed calls), not SGLang's speed.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

import megaflow  # noqa: F401
from megaflow.bench.rollout import bench_rollout, make_requests
from megaflow.rollout.baseline import DiffusersEngine, DiffusersEngineConfig

REPO = Path(__file__).resolve().parents[2]


def test_bench_rollout_result_shape(tmp_path):
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("make_tiny_pipeline", REPO / "tools" / "make_tiny_pipeline.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    pipeline_dir = str(tool.make_tiny_pipeline("sd3", tmp_path / "tiny", seed=0))
    started = []

    def factory(path: str, engine_id: str):
        engine = DiffusersEngine.from_pretrained(path, config=DiffusersEngineConfig(engine_id=engine_id))
        started.append(engine)
        return engine

    out = bench_rollout(pipeline_dir, engines=(2, 1), groups=3, group_size=2, steps=1, res=32, warmup=0,
                        repeats=2, engine_factory=factory)
    json.dumps(out)  # JSON-able
    assert [e.engine_id for e in started] == ["sglang-0", "sglang-1"], "engines are added as the count grows"
    assert all(not e.health().alive for e in started), "the bench shuts its engines down"
    assert out["engines"] == [2, 1] and set(out["images_per_s"]) == {"1", "2"}
    assert [len(out["engine_start_s"][k]) for k in ("1", "2")] == [1, 2]
    for k in ("1", "2"):
        run = out["runs"][k]
        assert run["engines"]["images_per_call"] == run["baseline"]["images_per_call"] == 6
        assert len(run["engines"]["call_seconds"]) == 2 and run["engines"]["balancer"]["num_images"] == 12
        assert out["ratio_per_engine_count"][k] == round(out["images_per_s"][k] / run["baseline"]["images_per_s"], 3)
    # 3 groups over 2 engines: split 2/1 by in-flight counts on each of the 2 calls
    per_engine = out["runs"]["2"]["engines"]["balancer"]["engines"].values()
    assert sum(row["num_requests"] for row in per_engine) == 6
    assert min(row["num_requests"] for row in per_engine) >= 2
    assert max(row["max_in_flight"] for row in per_engine) == 2
    assert out["ratio"] == out["ratio_per_engine_count"]["2"] and out["ratio_median"] > 0
    assert out["baseline_images_per_s"] == round(out["runs"]["2"]["baseline"]["images_per_s"], 3)


def test_make_requests_seeds_are_distinct():
    reqs = make_requests(groups=3, group_size=4, steps=2, res=32, seed=5)
    seeds = [s for r in reqs for s in r.output_seeds()]
    assert len(set(seeds)) == 12 and seeds[0] == 5
    assert len({r.request_id for r in reqs}) == 3 and all(r.num_outputs == 4 for r in reqs)
