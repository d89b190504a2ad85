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
