"""The megatron DiffusionNFT phase equals a plain-torch transcription on the diffusers DiT
(tests/trainer/nft_workers.py: ``nft_reference``), on a tiny SD3, and is the same at TP=2 and DP=2.

Needs: CPU, gloo worlds of 1 and 2 (run_multiprocess), diffusers. Case: 7 ODE samples of 4 steps from a
perturbed θ_old, one not kept; 2 grid timesteps per sample (12 items) in 2 optimizer steps (SGD, lr 0.05),
β = 0.5, a perturbed reference with κ = 0.3 (the KL gradient is non-zero), one advantage beyond the clip.

Tolerances (relative L2 of the weight change over all parameters): TP=1 vs the reference <= 2e-5
(megatron vs diffusers forward rounding, compounded over 2 steps); TP=2 and DP=2 vs TP=1 <= 1e-5; the EMA
after the phase equals the reference's blend of the per-step weights, (1 − d_n) steps with
d_n = min(0.9, (1 + n)/(10 + n)) (n = 1, 2: the step the blend follows), to the same tolerance.
"""
from __future__ import annotations

import pytest
import torch

from megaflow.testing.dist import run_multiprocess

import nft_workers as W

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
    return W.nft_reference(**CASE)


@pytest.fixture(scope="module")
def tp1():
    (out,) = run_multiprocess(W.nft_rank, 1, 1, 5, CASE, timeout_s=600)
    return out


def test_nft_phase_matches_the_plain_reference(tp1, reference):
    assert _rel_change(tp1["state"], reference["state"], reference["before"]) <= 2e-5
    s = tp1["stats"]
    assert s["num_updates"] == 2 and s["num_items"] == 12 and s["update_ok"] == 1.0
    assert s["kl"] > 0 and s["old_deviation"] > 0


def test_ema_follows_every_optimizer_step(tp1, reference):
    ema = {k: v.clone() for k, v in reference["before"].items()}
    for n, state in enumerate(reference["states"], start=1):
        d = min(0.9, (1 + n) / (10 + n))
        ema = {k: d * ema[k] + (1 - d) * state[k] for k in ema}
    assert tp1["ema_updates"] == 2
    assert _rel_change(tp1["ema"], ema, reference["before"]) <= 2e-5


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_nft_phase_is_layout_independent(tp, tp1):
    outs = run_multiprocess(W.nft_rank, 2, tp, 2, CASE, timeout_s=600)
    before = W.sample_case()[0].state_dict()
    for out in outs:
        assert _rel_change(out["state"], tp1["state"], before) <= 1e-5
        assert out["stats"]["num_items"] == 12


@pytest.mark.slow
def test_lora_nft_equals_full_before_the_update_and_is_layout_independent():
    """LoRA (B = 0 at start) computes the full model's velocities, so the on-policy phase's loss and KL equal the
    full-parameter run's (1e-6); θ_old and the EMA hold only the adapters; TP=2 LoRA equals TP=1 (1e-5)."""
    case = {**CASE, "num_minibatches": 1, "on_policy": True}
    (full,) = run_multiprocess(W.nft_rank, 1, 1, 5, case, timeout_s=600)
    (lora,) = run_multiprocess(W.nft_rank, 1, 1, 5, {**case, "lora": True}, timeout_s=600)
    for key in ("policy_loss", "kl", "x0_error"):
        assert lora["stats"][key] == pytest.approx(full["stats"][key], rel=1e-6), key
    assert lora["stats"]["old_deviation"] == 0.0  # on-policy: θ_old = θ when v_old is taken
    assert lora["shadow_names"] and all(".lora." in n for n in lora["shadow_names"])
    assert len(lora["shadow_names"]) < len(full["shadow_names"])
    tp2 = run_multiprocess(W.nft_rank, 2, 2, 5, {**case, "lora": True}, timeout_s=600)
    before = {k: torch.zeros_like(v) if "lora_B" in k else v for k, v in lora["state"].items()}
    for out in tp2:
        assert _rel_change(out["state"], lora["state"], before) <= 1e-5
