"""TIS / MIS weights at the step, trajectory and geometric levels against a plain-torch transcription of
their definitions (written here without megaflow.algo), and a case where the three levels must differ.
Needs: CPU, 1 process.

Definitions (TIS/MIS as in slime's mis.py / verl rollout IS): per sample i and trained step t,
r_it = logp_train - logp_rollout; step: w_it = exp(r_it); trajectory: w_i = exp(sum_t r_it) (the product of
the step ratios); geometric: w_i = exp(mean_t r_it). TIS truncates w to [floor, C]; MIS zeroes (and drops)
entries with w outside [floor, C]. Tolerance: fp32 (rtol 1e-6).
"""
from __future__ import annotations

import math

import pytest
import torch

from megaflow.algo.flowgrpo import MismatchConfig, mismatch_weights


def reference(train, rollout, mask, mode, level, cap, floor):
    """Loops over samples and steps in float64; returns (weights, keep) as nested lists."""
    weights, keep = [], []
    for i in range(len(train)):
        steps = [t for t in range(len(train[i])) if mask[i][t]]
        r = {t: float(train[i][t]) - float(rollout[i][t]) for t in steps}
        if level == "trajectory":
            sample_w = math.prod(math.exp(r[t]) for t in steps)
        elif level == "geometric":
            sample_w = math.exp(sum(r.values()) / len(steps))
        row_w, row_k = [], []
        for t in range(len(train[i])):
            if t not in r:
                row_w.append(0.0), row_k.append(False)
                continue
            w = math.exp(r[t]) if level == "step" else sample_w
            if mode == "tis":
                row_w.append(min(max(w, floor), cap)), row_k.append(True)
            else:
                inside = floor <= w <= cap
                row_w.append(w if inside else 0.0), row_k.append(inside)
        weights.append(row_w), keep.append(row_k)
    return weights, keep


@pytest.mark.parametrize("level", ["step", "trajectory", "geometric"])
@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_levels_match_plain_transcription(level, mode):
    g = torch.Generator().manual_seed(0)
    rollout = torch.randn(6, 5, generator=g)
    train = rollout + 0.4 * torch.randn(6, 5, generator=g) + 0.3 * torch.randn(6, 1, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.25
    mask[:, 0] = True  # every sample has a trained step
    cap, floor = 1.3, 0.8
    cfg = MismatchConfig(mismatch=mode, mismatch_level=level, mismatch_cap=cap, mismatch_floor=floor)
    out = mismatch_weights(train, rollout, cfg, mask=mask)
    ref_w, ref_k = reference(train.tolist(), rollout.tolist(), mask.tolist(), mode, level, cap, floor)
    torch.testing.assert_close(out.weights, torch.tensor(ref_w), rtol=1e-6, atol=1e-7)
    assert out.keep.tolist() == ref_k
    if mode == "mis":  # the case is not degenerate: some rejected, some kept
        assert 0 < int((mask & ~out.keep).sum()) < int(mask.sum())


def test_three_levels_differ_where_they_must():
    # one sample, three steps with log-ratios 0.5, -0.1, 0.2: per step e^.5, e^-.1, e^.2; the product
    # e^.6 = 1.82; the geometric mean e^.2 = 1.22 (no truncation reached with C = 3).
    rollout = torch.zeros(1, 3)
    train = torch.tensor([[0.5, -0.1, 0.2]])
    got = {level: mismatch_weights(train, rollout, MismatchConfig(mismatch_level=level, mismatch_cap=3.0)).weights
           for level in ("step", "trajectory", "geometric")}
    torch.testing.assert_close(got["step"], torch.tensor([[math.exp(0.5), math.exp(-0.1), math.exp(0.2)]]))
    torch.testing.assert_close(got["trajectory"], torch.full((1, 3), math.exp(0.6)))
    torch.testing.assert_close(got["geometric"], torch.full((1, 3), math.exp(0.2)))
    assert not torch.allclose(got["step"], got["trajectory"]) and not torch.allclose(got["step"], got["geometric"])
    assert not torch.allclose(got["trajectory"], got["geometric"])


def test_sample_levels_refuse_one_step_at_a_time():
    """A [B] input is one step per entry: trajectory / geometric cannot be computed from it."""
    for level in ("trajectory", "geometric"):
        with pytest.raises(ValueError, match="needs \\[B, T\\]"):
            mismatch_weights(torch.zeros(4), torch.zeros(4), MismatchConfig(mismatch_level=level))
    mismatch_weights(torch.zeros(4), torch.zeros(4), MismatchConfig(mismatch_level="step"))
