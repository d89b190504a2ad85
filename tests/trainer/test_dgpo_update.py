"""The megatron DGPO step equals a plain-torch transcription on the diffusers DiT (tests/trainer/dgpo_workers.py:
``dgpo_reference``), on a tiny SD3, and is the same at TP=2 and DP=2 (where the preference groups span ranks and
their scores are summed over DP).

Needs: CPU, gloo worlds of 1 and 2 (run_multiprocess), diffusers. Case: 7 ODE samples of 4 steps in prompt groups
of 4 (the second group has 3 samples, one not kept), 2 shared grid indices of 0..2 (12 items in 4 preference
groups, microbatches of 5 so groups span microbatches), β = 50, a perturbed fast EMA as the reference and clip
ε = 2e-3 (some items clipped), a perturbed KL reference (κ = 0.3), one advantage beyond the clip; SGD lr 0.05.

Tolerances: the weight change, relative L2, TP=1 vs the reference <= 2e-5 (megatron vs diffusers forward
rounding); TP=2 and DP=2 vs TP=1 <= 1e-5; the loss summed over the microbatches vs the transcription's <= 1e-5
relative; the clipped fraction exactly.

LoRA equals full: rank-4 adapters (B = 0) compute the base model, and the fast EMA is the same adapters with a
random B; the full-parameter run gets that EMA merged (W + scale·B@A). Before the step every loss term equals the
full run's (rel 1e-6); after one SGD step every B equals −lr·scale·G·Aᵀ with G the full run's grad of W (the
chain rule of W + scale·B@A at B = 0), to 1e-5 relative L2 over all adapters (fp32 backward rounding).
"""
from __future__ import annotations

import pytest
import torch

from megaflow.testing.dist import run_multiprocess

import dgpo_workers as W
import nft_workers as N

pytestmark = [pytest.mark.dist]
CASE = dict(lr=0.05)


def _rel_change(a: dict, b: dict, before: dict) -> float:
    keys = [k for k in before if not k.endswith("pos_embed")]  # a buffer, never trained
    num = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in keys)
    den = sum(float((b[k] - before[k]).double().pow(2).sum()) for k in keys)
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return W.dgpo_reference(**CASE)


@pytest.fixture(scope="module")
def tp1():
    (out,) = run_multiprocess(W.dgpo_rank, 1, 1, 5, CASE, timeout_s=600)
    return out


def test_dgpo_step_matches_the_plain_reference(tp1, reference):
    assert _rel_change(tp1["state"], reference["state"], reference["before"]) <= 2e-5
    s = tp1["stats"]
    assert s["num_updates"] == 1 and s["num_items"] == reference["num_items"] == 12 and s["update_ok"] == 1.0


def test_dgpo_loss_equals_the_transcription(tp1, reference):
    assert tp1["loss"] == pytest.approx(reference["loss"], rel=1e-5)
    assert 0.0 < reference["clip_frac"] < 1.0
    assert tp1["stats"]["clip_frac"] == pytest.approx(reference["clip_frac"], abs=1e-6)
    assert tp1["stats"]["kl"] > 0


def test_group_noise_and_timesteps_are_shared():
    items, groups, noise = W.plan(N.sample_case()[3])
    assert len({k for _, k in items}) == 2 and all(k <= 2 for _, k in items)
    for g in set(groups.tolist()):
        members = [j for j in range(len(items)) if int(groups[j]) == g]
        assert len({items[j][1] for j in members}) == 1  # one timestep per preference group
        assert all(torch.equal(noise[j], noise[members[0]]) for j in members)  # one ε per group
    assert len(set(groups.tolist())) == 4 and not torch.equal(noise[0], noise[-1])


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_dgpo_step_is_layout_independent(tp, tp1):
    outs = run_multiprocess(W.dgpo_rank, 2, tp, 3, CASE, timeout_s=600)
    before = N.sample_case()[0].state_dict()
    for out in outs:
        assert _rel_change(out["state"], tp1["state"], before) <= 1e-5
        assert out["loss"] == pytest.approx(tp1["loss"], rel=1e-6)


@pytest.fixture(scope="module")
def lora_and_full():
    (lora,) = run_multiprocess(W.dgpo_rank, 1, 1, 5, {**CASE, "lora": True}, timeout_s=600)
    (full,) = run_multiprocess(W.dgpo_rank, 1, 1, 5, {**CASE, "ema_state": lora["ema_merged"]}, timeout_s=600)
    return lora, full


def test_lora_dgpo_equals_full_before_the_update(lora_and_full):
    """LoRA (B = 0 at start) computes the full model's velocities, and its fast EMA (adapters only) the merged
    EMA's, so the step's loss and every loss term equal the full-parameter run's (1e-6)."""
    lora, full = lora_and_full
    assert lora["loss"] == pytest.approx(full["loss"], rel=1e-6)
    for key in ("policy_loss", "kl", "matching_loss", "ref_deviation", "group_weight", "clip_frac", "num_items"):
        assert lora["stats"][key] == pytest.approx(full["stats"][key], rel=1e-6, abs=1e-12), key
    s = full["stats"]  # the compared terms are not trivial: the EMA differs from θ, some items are clipped
    assert s["kl"] > 0 and s["ref_deviation"] != 0 and s["group_weight"] != 0.5 and 0 < s["clip_frac"] < 1
    assert lora["shadow_names"] and all(".lora." in n for n in lora["shadow_names"])
    assert len(lora["shadow_names"]) < len(full["shadow_names"])


def test_lora_dgpo_step_is_the_full_step_through_a(lora_and_full):
    """One SGD step from B = 0 moves B by −lr·scale·G·Aᵀ (G: the full run's grad of W; A's own grad is 0)."""
    lora, full = lora_and_full
    scale, num, den, count = N.lora_settings().scale, 0.0, 0.0, 0
    for name, b in lora["state"].items():
        if name.endswith(".lora_B.weight"):
            module = name.removesuffix(".lora_B.weight")
            a = lora["state"][f"{module}.lora_A.weight"].double()
            expected = -CASE["lr"] * scale * full["grads"][f"{module}.weight"].double() @ a.T
            num += float((b.double() - expected).pow(2).sum())
            den += float(expected.pow(2).sum())
            count += 1
    assert count >= 8 and den > 0 and (num / den) ** 0.5 <= 1e-5
