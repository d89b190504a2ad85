"""``megaflow.bench.loops.summarize`` on hand-written metrics rows. Needs: CPU, 1 process, < 1 s.
(The launches themselves are what tests/run/test_launch_multinode.py runs.)"""
import pytest

from megaflow.bench.loops import summarize


def _row(it, iteration_s, hosts=2):
    row = {"iteration": it, "sync/hosts": float(hosts), "sync/verified": 1.0, "sync/seconds": 0.5}
    if it:
        row.update({"time/iteration_s": iteration_s, "time/rollout_s": 1.0, "time/sample_s": 0.9, "time/train_s": 0.4,
                    **{f"rollout/host{h}/images": 8.0 for h in range(hosts)}})
    return row


def test_summarize_skips_the_warmup_iteration_and_takes_medians():
    rows = [_row(0, 0), _row(1, 100.0), _row(2, 2.0), _row(3, 4.0), _row(4, 3.0)]
    s = summarize(rows)
    assert s["iterations_timed"] == 3 and s["time_iteration_s"] == 3.0  # median of 2, 4, 3; 100 (warm-up) left out
    assert s["images_per_iteration"] == 16.0 and s["images_per_s"] == pytest.approx(16 / 3)
    assert s["hosts"] == 2 and s["syncs_verified"]
    with pytest.raises(ValueError, match="at least 2 iterations"):
        summarize(rows[:2])


def test_overlap_against_the_ideal_from_the_synchronous_phases():
    """ideal = (rollout + train) / max(rollout, train) of the synchronous run; the asynchronous iteration's time
    beyond its ideal split into waits, sync, rewards and each phase's slowdown (hand-worked numbers)."""
    from megaflow.bench.loops import overlap

    sync = {"time_iteration_s": 12.0, "time_rollout_s": 4.4, "time_train_s": 7.5, "time_sample_s": 4.0,
            "sync_seconds": 0.1}
    ahead = {"time_iteration_s": 9.0, "time_rollout_s": 0.2, "time_train_s": 8.5, "time_sample_s": 6.0,
             "sync_seconds": 0.1, "time_ahead_wait_s": 0.1, "time_score_after_sample_s": 0.3}
    o = overlap(sync, ahead, achieved=12.0 / 9.0)
    assert o["ideal_ratio"] == pytest.approx(11.9 / 7.5)
    assert o["achieved_over_ideal"] == pytest.approx((12.0 / 9.0) / (11.9 / 7.5))
    assert o["ideal_iteration_s"] == pytest.approx(12.0 * 7.5 / 11.9)
    assert o["beyond_ideal_s"] == pytest.approx(9.0 - 12.0 * 7.5 / 11.9)
    assert o["trainer_idle_s"] == pytest.approx(0.3) and o["engine_idle_s"] == pytest.approx(3.0)
    assert o["rewards_s"] == 0.3 and o["sync_s"] == 0.1
    assert o["contention_train_s"] == pytest.approx(1.0) and o["contention_sample_s"] == pytest.approx(2.0)


def test_summarize_keeps_the_optional_parts_every_row_has():
    rows = [_row(0, 0), _row(1, 2.0), _row(2, 2.0), _row(3, 2.0)]
    for r in rows[1:]:
        r["time/ahead_wait_s"] = 0.5
    rows[2]["time/score_after_sample_s"] = 0.1  # one row only: left out
    s = summarize(rows)
    assert s["time_ahead_wait_s"] == 0.5 and "time_score_after_sample_s" not in s
