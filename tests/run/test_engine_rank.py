"""Disaggregated placement against a single-process run: ``megaflow demo`` under torchrun with 2 ranks, rank 1
only sampling (rollout.placement = "disaggregated", rollout.engine_ranks = 1, the distributed bridge), and the
same demo in one process (its engine beside its trainer, the shared-memory bridge).

Reference: the single-process run. Both train one trainer rank from the same weights, seeds and prompts,
and both engines are the same SGLang engine on the same weights, so the runs must agree exactly: the
evaluation images (sampled on the engine rank and sent to the driver, ``generate``), every
iteration's rewards and training statistics (sampled and scored on the engine rank, sent to the
trainer, ``collect``) and the evaluation after training (weights moved by the distributed bridge, ``sync``).
Tolerance: bit-equal PNGs and metrics equal to 1e-6 relative (the same computation on the same CPU).
Needs: CPU, 2 short demo runs (~40 s each).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megaflow.testing.dist import free_port

REPO = Path(__file__).resolve().parents[2]
# eval.num_train: 4 train prompts still take the train-prompt evaluation through the engine rank (the config's
# 300 sampled 1200 of the two runs' 1680 images)
SETS = ["train.iterations=2", "eval.num=20", "eval.num_seen=4", "eval.num_train=4", "logging.sample_every=0"]
COMPARED = ("reward/total", "train/loss", "train/approx_kl", "train/clip_frac", "adv/dropped_ratio")


def _demo(out: Path, launcher: list[str], extra: list[str]) -> Path:
    sets = [a for s in [*SETS, f'run.output_dir="{out}"', *extra] for a in ("--set", s)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([*launcher, "-m", "megaflow.cli", "demo", *sets], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    (run_dir,) = [p for p in out.iterdir() if (p / "summary.json").is_file()]
    return run_dir


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.engine
def test_disaggregated_demo_equals_single_process(tmp_path):
    python = sys.executable
    torchrun = str(Path(python).parent / "torchrun")
    dis = _demo(tmp_path / "dis", [torchrun, "--nproc-per-node", "2", "--master-port", str(free_port())],
                ["rollout.placement=disaggregated", "rollout.engine_ranks=1", "bridge.mode=distributed"])
    one = _demo(tmp_path / "one", [python], [])
    sd, so = (json.loads((d / "summary.json").read_text()) for d in (dis, one))
    assert sd["launch"] == {"world_size": 2, "placement": "disaggregated", "engine_ranks": 1,
                            "engine_hosts": "rank0", "bridge": "distributed"}
    assert so["launch"]["world_size"] == 1 and so["launch"]["placement"] == "colocated"
    for when in ("before", "after"):
        pngs = sorted((one / f"eval_{when}").glob("0*.png"))
        assert len(pngs) == 24
        for png in pngs:
            assert png.read_bytes() == (dis / f"eval_{when}" / png.name).read_bytes(), f"eval_{when}/{png.name}"
        assert sd[f"shapeeval_{when}"] == so[f"shapeeval_{when}"]
        assert sd[f"train_prompts_{when}"] == so[f"train_prompts_{when}"]
    rows = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (dis, one)]
    assert [r["iteration"] for r in rows[0]] == [r["iteration"] for r in rows[1]] == [0, 1, 2]
    for rd, ro in zip(*rows):
        assert rd["sync/verified"] == ro["sync/verified"] == 1.0
        for key in COMPARED:
            if key in ro:
                assert rd[key] == pytest.approx(ro[key], rel=1e-6, abs=1e-12), (rd["iteration"], key)
        if rd["iteration"]:
            assert "rollout/host0/images" not in rd  # sampled on the engine rank 1 only
            assert rd["rollout/host1/images"] == ro["rollout/host0/images"] > 0
