"""reward.timeout_s: a reward call that has not returned within the limit masks its batch (like a reward that
raised), is counted in ``reward/<label>_timeouts`` (summed over batches and carried in a host's share), and is
abandoned on a daemon thread: the next batch neither waits for it nor queues behind it on the scorer's pool.
Needs: CPU, 1 process (~3 s)."""
import threading
import time

import torch

from megaflow.rewards import AsyncScorer, build_multi_reward
from megaflow.rewards.base import last_failure
from megaflow.rewards.scorer import call_within
from megaflow.rollout.exchange import pack_share, unpack_share
from megaflow.rollout.types import RewardScores, RolloutRequest, Trajectory

torch.set_num_threads(1)

SLOW_ONCE = """
import threading, time
import torch
calls = []
release = threading.Event()

def reward(images, prompts, metadata):
    calls.append(len(prompts))
    if len(calls) == 1:
        release.wait(30)  # the first call hangs (until the test lets it go)
    return torch.ones(len(prompts))
"""


def _images(n: int) -> torch.Tensor:
    return torch.full((n, 3, 4, 4), 0.5)


def test_a_reward_past_the_timeout_is_masked_counted_and_the_next_batch_works(tmp_path, monkeypatch):
    (tmp_path / "megaflow_test_slow_reward.py").write_text(SLOW_ONCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import megaflow_test_slow_reward as mod
    name = "megaflow_test_slow_reward:reward"
    multi = build_multi_reward({name: 1.0, "jpeg_compressibility": 0.0}, timeout_s=0.5)
    scorer = AsyncScorer(multi, num_workers=1)  # one worker: a stuck call must not hold it
    try:
        t0 = time.perf_counter()
        first = scorer.submit(_images(2), ["a", "b"]).result(timeout=20)
        assert 0.5 <= time.perf_counter() - t0 < 10
        assert torch.isnan(first.total).all() and torch.isnan(first.components[name]).all()
        assert first.timeouts == {name: 1, "jpeg_compressibility": 0}
        summary = first.summary()
        assert summary["reward/megaflow_test_slow_reward:reward_timeouts"] == 1.0
        assert summary["reward/jpeg_compressibility_timeouts"] == 0.0
        assert torch.isfinite(first.components["jpeg_compressibility"]).all()  # the others still score
        assert "timed out" in last_failure(name)
        second = scorer.submit(_images(3), ["c", "d", "e"]).result(timeout=20)  # the first call still hangs
        torch.testing.assert_close(second.total, torch.ones(3))
        assert second.timeouts[name] == 0 and mod.calls == [2, 3]
        both = RewardScores.concat([first, second])
        assert both.timeouts[name] == 1 and both.summary()[f"reward/{name}_timeouts"] == 1.0
        stuck = [t for t in threading.enumerate() if t.name == f"megaflow-reward-{name}"]
        assert stuck and all(t.daemon for t in stuck)  # abandoned: never holds the process at exit
    finally:
        mod.release.set()
        scorer.close()


def test_no_limit_runs_on_the_callers_thread_and_errors_pass_through():
    assert call_within(threading.current_thread, 0.0, name="x") is threading.current_thread()
    assert call_within(threading.current_thread, 5.0, name="x") is not threading.current_thread()
    try:
        call_within(lambda: 1 / 0, 5.0, name="x")
    except ZeroDivisionError:
        pass
    else:
        raise AssertionError("the call's exception was not raised on the caller's thread")


def test_timeouts_travel_in_a_hosts_share():
    request = RolloutRequest(prompt="p", num_outputs=2)
    trajs = [Trajectory(**request.trajectory_fields(), index=j, seed=s, log_prob_no_const=False,
                        latents=torch.zeros(2, 1, 2, 2), sigmas=torch.tensor([1.0, 0.0]), log_probs=torch.zeros(1),
                        sde_mask=torch.ones(1, dtype=torch.bool), conditioning={"pooled_projections": torch.zeros(2)})
             for j, s in enumerate(request.output_seeds())]
    scores = RewardScores(total=torch.full((2,), float("nan")), components={"a": torch.full((2,), float("nan"))},
                          weights={"a": 1.0}, seconds={"a": 0.5}, timeouts={"a": 1})
    _, back = unpack_share(pack_share(trajs, scores, 1.0), [request], host=0)
    assert back.timeouts == {"a": 1}
