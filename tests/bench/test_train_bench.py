"""``megaflow bench train --json`` end to end (1 process, ~20 s): the megatron SFT step against the diffusers SD3
step on the same weights and batch.

Checks the bench's result, not its speed: the two models' velocities agree (fp32, 1e-5), both steps see the same
loss (1e-5), megatron's fast paths left every weight bit-identical to megatron's own code after the same steps,
and the ratios are the reported times' quotients."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_bench_train_result():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "megaflow.cli", "bench", "train", "--json", "--repeats", "2",
                        "--warmup", "1"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["max_abs_diff"] <= 1e-5 and abs(result["loss_diff"]) <= 1e-5, result
    assert result["fast_paths_bit_identical"] is True
    assert len(result["megatron_ms_all"]) == len(result["diffusers_ms_all"]) == 2
    assert result["ratio"] == pytest.approx(result["megatron_ms"] / result["diffusers_ms"], rel=1e-2)
    assert result["params"] > 0 and result["spec"] == "local"
