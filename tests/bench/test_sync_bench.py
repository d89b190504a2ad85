"""``megaflow bench sync`` end to end on a small "large" DiT (1 block): one real SGLang engine (~30 s).

Checks the bench's result: byte and parameter counts of the scaled DiT (diffusers' own count as the
reference), both sync modes timed and reported against the plain copy, and the engine holding exactly
the pushed bytes afterwards (SGLang's checksum)."""
from __future__ import annotations

import pytest
import torch

import megaflow  # noqa: F401
import megaflow.rollout.sglang.engine  # noqa: F401  (the adapter the bench drives: an import error fails here)

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_bench_sync_result(tmp_path):
    from diffusers import SD3Transformer2DModel

    from megaflow.bench.sync import bench_sync, make_large_pipeline
    dit = SD3Transformer2DModel.from_pretrained(make_large_pipeline(tmp_path / "p", layers=1, heads=4, head_dim=16)
                                                / "transformer")
    assert dit.config.num_layers == 1 and dit.config.caption_projection_dim == 64
    result = bench_sync(layers=1, heads=4, head_dim=16, repeats=2, warmup=0, tiny=False)
    large = result["large"]
    assert large["params"] == sum(t.numel() for t in dit.state_dict().values())
    assert large["bytes"] == 4 * large["params"] and large["bit_exact"]
    for key in ("no_verify", "verify"):
        assert large["sync_s"][key] > 0 and large["copy_s"] > 0
        assert large["ratio_vs_copy"][key] == pytest.approx(large["sync_s"][key] / large["copy_s"], rel=1e-2)
    torch.testing.assert_close(torch.tensor(large["per_engine_s"]["verify"]), torch.tensor(large["sync_s"]["verify"]))
    phases = large["phase_s"]
    assert set(phases) == {"copy", "gather", "convert", "pack", "digest", "push", "verify"}
    for key, seconds in phases.items():
        rate = large["phase_gb_per_s"][key]
        assert rate is None if seconds == 0 else rate == pytest.approx(large["bytes"] / seconds / 1e9, rel=1e-2)
    assert set(large["cpu_ratio_vs_copy"]) == {"no_verify", "verify"} and large["phase_cpu_s"]["copy"] > 0
