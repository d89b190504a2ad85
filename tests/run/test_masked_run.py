"""A run whose rewards mask every sample stops loudly (train.max_masked_iterations): MaskedWatch on hand-made
scores (fast), and `megaflow train` with a reward returning the wrong length (slow: a real SGLang engine).
Needs: CPU, 1 process (the end-to-end test ~1 min)."""
from __future__ import annotations

import subprocess

import pytest
import torch
from reward_runs import train_with_reward

from megaflow.rewards.base import safe_score
from megaflow.rollout.types import RewardScores
from megaflow.run.masked import MaskedWatch

NAN = float("nan")


def _scores(**components: list[float]) -> RewardScores:
    comps = {k: torch.tensor(v) for k, v in components.items()}
    weights = {k: (0.0 if k.startswith("shown") else 1.0) for k in comps}
    total = sum(w * comps[k] for k, w in weights.items() if w)
    return RewardScores(total=total, components=comps, weights=weights, seconds={k: 0.0 for k in comps})


def test_watch_counts_fully_masked_iterations_in_a_row_and_names_the_reward():
    def short(images, prompts, metadata):
        return torch.zeros(len(prompts) + 1)
    safe_score(short, torch.zeros(2, 3, 8, 8), ["a", "b"], name="short")  # records why it masked
    w = MaskedWatch(2)
    w.see(_scores(short=[NAN, NAN], ok=[1.0, 2.0]))
    assert w.verdict(1) is None
    w.see(_scores(short=[1.0, 2.0], ok=[1.0, 2.0]))  # a scored sample resets the count
    w.see(_scores(short=[NAN, NAN], ok=[1.0, 2.0], shown=[NAN, NAN]))
    assert w.verdict(3) is None
    w.see(_scores(short=[NAN, NAN], ok=[1.0, 2.0], shown=[NAN, NAN]))
    msg = w.verdict(4)
    assert msg is not None and "iterations 3..4" in msg and "train.max_masked_iterations = 2" in msg
    assert "reward 'short': ValueError: reward 'short' returned shape (3,), expected (2,)" in msg, msg
    assert "'ok'" not in msg and "'shown'" not in msg  # scored everything / weight 0: not the cause
    never = MaskedWatch(0)
    for _ in range(5):
        never.see(_scores(a=[NAN]))
    assert never.verdict(5) is None


def test_watch_names_rewards_that_mask_different_samples():
    w = MaskedWatch(1)
    w.see(_scores(a=[NAN, 1.0], b=[1.0, NAN]))
    msg = w.verdict(1)
    assert "reward 'a'" in msg and "reward 'b'" in msg


@pytest.mark.slow
@pytest.mark.engine
def test_train_with_a_wrong_length_reward_stops_after_k_iterations(tmp_path):
    (tmp_path / "badreward.py").write_text(
        "import torch\n"
        "def score(images, prompts, metadata):\n"
        "    return torch.zeros(len(prompts) + 1)  # one score too many\n")
    cmd, env = train_with_reward(tmp_path, "masked", "badreward:score",
                                 ["train.iterations=10", "train.max_masked_iterations=2"])
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode != 0 and lines, r.stderr[-3000:]
    last = lines[-1]
    assert last.startswith("megaflow: ") and "reward 'badreward:score'" in last, r.stderr[-3000:]
    assert "iterations 1..2" in last and "returned shape" in last, last
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert (tmp_path / "runs" / "masked" / "checkpoints").is_dir()  # the iteration it stopped at is kept
