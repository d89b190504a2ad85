"""A run whose rewards mask every sample stops loudly (train.max_masked_iterations, and at the end of a run whose
every iteration was one): MaskedWatch on hand-made scores (fast); `megaflow train` (slow: a real SGLang engine)
with a reward returning the wrong length (stops at once: RewardContractError), and with a reward that times out
on every batch and leaves child processes (stops non-zero naming it; its children end with the run).
Needs: CPU, 1 process (the end-to-end tests ~1 min each)."""
from __future__ import annotations

import json
import subprocess
import time

import psutil
import pytest
import torch
from reward_runs import train_with_reward

from megaflow.rewards.base import RewardContractError, safe_score
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
        raise RuntimeError("the server said no")
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
    assert "reward 'short': RuntimeError: the server said no" in msg, msg
    assert "'ok'" not in msg and "'shown'" not in msg  # scored everything / weight 0: not the cause
    never = MaskedWatch(0)
    for _ in range(5):
        never.see(_scores(a=[NAN]))
    assert never.verdict(5) is None


def test_a_run_whose_every_iteration_was_masked_ends_non_zero_even_below_the_limit():
    w = MaskedWatch(3)
    w.see(_scores(a=[NAN, NAN]))
    assert w.verdict(1) is None  # not the last iteration: one in a row is below the limit
    w.see(_scores(a=[NAN, NAN]))
    msg = w.verdict(2, last=True)
    assert msg is not None and "iterations 1..2" in msg and "every iteration of this run" in msg and "'a'" in msg
    partly = MaskedWatch(3)
    partly.see(_scores(a=[1.0, NAN]))
    partly.see(_scores(a=[NAN, NAN]))
    assert partly.verdict(2, last=True) is None  # iteration 1 trained on a sample
    assert MaskedWatch(0).verdict(1, last=True) is None


def test_a_reward_returning_the_wrong_length_is_an_error_not_a_mask():
    def short(images, prompts, metadata):
        return torch.zeros(len(prompts) + 1)

    for prompts in (["a", "b"], ["a"]):
        with pytest.raises(RewardContractError) as e:
            safe_score(short, torch.zeros(len(prompts), 3, 8, 8), prompts, name="short")
        assert "\n" not in str(e.value) and f"shape ({len(prompts) + 1},) for {len(prompts)} image" in str(e.value)

    def words(images, prompts, metadata):
        return ["good"] * len(prompts)
    with pytest.raises(RewardContractError, match="returned list, not scores"):
        safe_score(words, torch.zeros(2, 3, 8, 8), ["a", "b"], name="words")


def test_watch_names_rewards_that_mask_different_samples():
    w = MaskedWatch(1)
    w.see(_scores(a=[NAN, 1.0], b=[1.0, NAN]))
    msg = w.verdict(1)
    assert "reward 'a'" in msg and "reward 'b'" in msg


@pytest.mark.slow
@pytest.mark.engine
def test_train_with_a_wrong_length_reward_stops_at_once(tmp_path):
    (tmp_path / "badreward.py").write_text(
        "import torch\n"
        "def score(images, prompts, metadata):\n"
        "    return torch.zeros(len(prompts) + 1)  # one score too many\n")
    cmd, env = train_with_reward(tmp_path, "masked", "badreward:score", ["train.iterations=10"])
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and lines, r.stderr[-3000:]
    assert lines[-1].startswith("megaflow: error: reward 'badreward:score' returned scores of shape (3,) for 2 "
                                "images"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "runs" / "masked").exists()  # failed before its first iteration: nothing left


HANGS = """
import subprocess, time
import torch

def score(images, prompts, metadata):
    subprocess.Popen(["sleep", "1000"])  # a helper the reward starts, then never returns
    time.sleep(1000)
    return torch.ones(len(prompts))
"""


@pytest.mark.slow
@pytest.mark.engine
def test_train_whose_reward_times_out_every_batch_stops_naming_it_and_its_children_end(tmp_path):
    (tmp_path / "hangs.py").write_text(HANGS)
    cmd, env = train_with_reward(tmp_path, "hung", "hangs:score", ["train.iterations=2", "reward.timeout_s=2"])
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: set[int] = set()
    while proc.poll() is None:  # every process the run starts, as it starts them
        try:
            children |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        except psutil.Error:
            pass
        time.sleep(0.2)
    _, err = proc.communicate(timeout=60)
    lines = [x for x in err.splitlines() if x.strip()]
    assert proc.returncode == 2 and lines, err[-3000:]
    assert lines[-1].startswith("megaflow: error: every sample of iterations 1..2 was masked (reward "
                                "'hangs:score': timed out"), err[-3000:]
    assert "every iteration of this run" in lines[-1] and "Traceback" not in err, err[-3000:]
    time.sleep(1)
    alive = [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], [psutil.Process(p).cmdline() for p in alive]
    rows = [json.loads(x) for x in (tmp_path / "runs" / "hung" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
