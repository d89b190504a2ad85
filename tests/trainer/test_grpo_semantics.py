"""The megatron GRPO step equals flow_grpo's training loop (``scripts/train_sd3.py``), transcribed in plain
torch on the diffusers DiT (tests/trainer/grpo_workers.py: ``flow_grpo_reference``), on a tiny SD3.

Needs: CPU, gloo worlds of 1 and 2 (run_multiprocess), diffusers. Case: 7 SDE trajectories of 4 steps,
one dropped by the zero-std filter, timestep_fraction 0.99 -> steps 0..2: 18 (sample, step) items;
β = 0.04 with a perturbed reference model (the KL gradient is non-zero).

Tolerances (relative L2 over all parameters):
- equal weighting: grads of one optimizer step with microbatches 16+2, 5+5+5+3, DP=2 (4 per microbatch,
  3 padding items per rank; 16 per microbatch, 7 padding items per rank) vs one microbatch of 18:
  <= 1e-6; each vs the flow_grpo reference: <= 2e-6 (megatron vs diffusers forward rounding);
- several optimizer steps (2 inner epochs x 2 minibatches, SGD lr 0.02, stale-policy clipping on):
  total weight change vs the reference <= 2e-5 (4 steps compound the rounding above), clip fractions
  to 1e-6; with TIS mismatch correction (old policy = trainer log-probs before the first step): the
  same update <= 1e-6 (trainer and sampler log-probs agree here, so w = 1), and at DP=2 <= 2e-5 vs the
  reference;
- CFG (guidance 4.5): trainer log-probs vs the sampling ones <= 1e-5, grads vs the reference <= 5e-6
  (the guided velocity amplifies rounding by ~g); recomputing without the guided velocity is off by > 1e-4.
"""
from __future__ import annotations

import pytest
import torch

from megaflow.testing.dist import run_multiprocess

import grpo_workers as W

pytestmark = [pytest.mark.dist]


def _rel(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def _params(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.endswith("pos_embed")}  # a buffer: no grad, not trained


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return W.reference_grads()


@pytest.fixture(scope="module")
def single():
    (out,) = run_multiprocess(W.equal_weight_rank, 1, [18, 16, 5], timeout_s=600)
    return out


def test_equal_weighting_whatever_the_microbatch_split(single, reference):
    one = _params(single[18]["grads"])
    for mbs, num_mbs in ((16, 2), (5, 4)):
        r = single[mbs]
        assert r["stats"]["num_microbatches"] == num_mbs and r["stats"]["num_items"] == 18
        assert _rel(_params(r["grads"]), one) <= 1e-6, mbs
    for mbs in (18, 16, 5):
        assert _rel(_params(single[mbs]["grads"]), reference) <= 2e-6, mbs
    s = single[18]["stats"]
    assert s["logp_abs_diff_rollout"] <= 1e-5 and s["kl"] > 0 and s["update_ok"] == 1.0


@pytest.mark.slow
def test_equal_weighting_across_data_parallel_ranks(single, reference):
    out = run_multiprocess(W.equal_weight_rank, 2, [4, 16], timeout_s=600)
    one = _params(single[18]["grads"])
    for mbs, num_mbs in ((4, 3), (16, 1)):
        g0, g1 = _params(out[0][mbs]["grads"]), _params(out[1][mbs]["grads"])
        assert all(torch.equal(g0[k], g1[k]) for k in g0)  # all-reduced
        assert out[0][mbs]["stats"]["num_microbatches"] == num_mbs
        assert _rel(g0, one) <= 1e-6, mbs
        assert _rel(g0, reference) <= 2e-6, mbs


@pytest.mark.slow
def test_several_optimizer_steps_match_flow_grpo_loop():
    lr = 0.02
    ref = W.multi_update_reference(lr)
    (plain,) = run_multiprocess(W.multi_update_rank, 1, lr, None, timeout_s=600)
    (tis,) = run_multiprocess(W.multi_update_rank, 1, lr, "tis", timeout_s=600)
    before = _params({k: v for k, v in ref["before"].items()})
    delta = {k: ref["state"][k] - before[k] for k in before}
    assert _rel({k: plain["state"][k] - before[k] for k in before}, delta) <= 2e-5
    clip = ref["clip_frac"]
    assert clip[0] == 0.0 and min(clip[1:]) > 0  # from the 2nd step on the clip acts on a stale policy
    s = plain["stats"]
    assert s["num_updates"] == 4 and s["num_items"] == 4 * 9
    assert s["clip_frac"] == pytest.approx(sum(clip) / 4, abs=1e-6)  # 4 equal-size steps
    assert s["clip_frac_stale"] == pytest.approx(sum(clip[1:]) / 3, abs=1e-6)
    assert _rel({k: tis["state"][k] - before[k] for k in before},
                {k: plain["state"][k] - before[k] for k in before}) <= 1e-6
    assert tis["stats"]["is_weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert tis["stats"]["clip_frac"] == pytest.approx(s["clip_frac"], abs=1e-6)
    dp2 = run_multiprocess(W.multi_update_rank, 2, lr, "tis", timeout_s=600)  # old log-probs gathered over DP
    for r in dp2:
        assert _rel({k: r["state"][k] - before[k] for k in before}, delta) <= 2e-5


@pytest.mark.slow
def test_cfg_guided_velocity_recompute_matches_flow_grpo_loop():
    ref = W.reference_grads(4.5)
    (out,) = run_multiprocess(W.equal_weight_rank, 1, [16], 4.5, timeout_s=600)
    assert out[16]["stats"]["logp_abs_diff_rollout"] <= 1e-5
    assert _rel(_params(out[16]["grads"]), ref) <= 5e-6
    assert out["without_cfg"]["logp_abs_diff_rollout"] > 1e-4  # 10x the tolerance above
