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
