"""The megatron AWM phase equals a plain-torch transcription on the diffusers DiT (tests/trainer/awm_workers.py:
``awm_reference``), on a tiny SD3, and is the same at TP=2 and DP=2.

Needs: CPU, gloo worlds of 1 and 2 (run_multiprocess), diffusers. Case: 7 ODE samples of 4 steps, one not kept;
2 stratified grid indices per sample (12 items) in 2 optimizer steps (SGD, lr 0.05); a perturbed fast EMA
(κ_e = 0.7) and reference (κ = 0.3); one advantage beyond the clip; ratio clip ε = 2e-3, so the second step's
ratio (to the weights before the first) is clipped for some items.

Tolerances: the weight change over all parameters, relative L2, TP=1 vs the reference <= 2e-5 (megatron vs
diffusers forward rounding over 2 steps); TP=2 and DP=2 vs TP=1 <= 1e-5; the loss terms (item means over the
phase) vs the reference's <= 1e-5 relative.
"""
from __future__ import annotations

import pytest
import torch

from megaflow.testing.dist import run_multiprocess

import awm_workers as W
import nft_workers as N

pytestmark = [pytest.mark.dist]
CASE = dict(lr=0.05, num_timesteps=2, num_minibatches=2)


def _rel_change(a: dict, b: dict, before: dict) -> float:
    keys = [k for k in before if not k.endswith("pos_embed")]  # a buffer, never trained
    num = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in keys)
    den = sum(float((b[k] - before[k]).double().pow(2).sum()) for k in keys)
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return W.awm_reference(**CASE)


@pytest.fixture(scope="module")
def tp1():
    (out,) = run_multiprocess(W.awm_rank, 1, 1, 5, CASE, timeout_s=600)
    return out


def test_awm_phase_matches_the_plain_reference(tp1, reference):
    assert _rel_change(tp1["state"], reference["state"], reference["before"]) <= 2e-5
    s = tp1["stats"]
    assert s["num_updates"] == 2 and s["num_items"] == 12 and s["update_ok"] == 1.0


def test_awm_loss_terms_equal_the_transcription(tp1, reference):
    steps = reference["steps"]
    assert steps[0]["clip_frac"] == 0.0 and 0.0 < steps[1]["clip_frac"] < 1.0  # the clip acts on step 2 only
    for key in ("policy_loss", "kl", "ema_kl", "clip_frac"):
        expected = sum(s[key] for s in steps) / len(steps)  # two steps of 6 items each
        assert tp1["stats"][key] == pytest.approx(expected, rel=1e-5, abs=1e-9), key
    assert tp1["stats"]["kl"] > 0 and tp1["stats"]["ema_kl"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_awm_phase_is_layout_independent(tp, tp1):
    outs = run_multiprocess(W.awm_rank, 2, tp, 2, CASE, timeout_s=600)
    before = N.sample_case()[0].state_dict()
    for out in outs:
        assert _rel_change(out["state"], tp1["state"], before) <= 1e-5
        assert out["stats"]["num_items"] == 12


@pytest.mark.slow
def test_lora_awm_equals_full_before_the_update():
    """LoRA (B = 0 at start) computes the full model's velocities, so one on-policy optimizer step's loss terms
    equal the full-parameter run's (1e-6); the fast EMA holds only the adapters."""
    case = {**CASE, "num_minibatches": 1, "on_policy": True}
    (full,) = run_multiprocess(W.awm_rank, 1, 1, 5, case, timeout_s=600)
    (lora,) = run_multiprocess(W.awm_rank, 1, 1, 5, {**case, "lora": True}, timeout_s=600)
    for key in ("policy_loss", "kl", "ema_kl", "clip_frac"):
        assert lora["stats"][key] == pytest.approx(full["stats"][key], rel=1e-6, abs=1e-12), key
    assert full["stats"]["kl"] > 0 and full["stats"]["policy_loss"] != 0  # the compared terms are not trivial
    assert lora["shadow_names"] and all(".lora." in n for n in lora["shadow_names"])
    assert len(lora["shadow_names"]) < len(full["shadow_names"])

