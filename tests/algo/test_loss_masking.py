"""Masked entries can never turn the FlowGRPO loss, the KL or the gradient into NaN, and the
``normalizer`` reduction (sum / global item count) used by the trainer. Needs: CPU, torch only.

Tolerance: exact (0) — masked entries are replaced with torch.where before any arithmetic, so the
loss and the gradient with NaN / ±inf injected there equal the clean ones bit for bit.
"""
import math

import pytest
import torch

import megaflow  # noqa: F401
from megaflow.algo.flowgrpo import LossConfig, MismatchConfig, flow_grpo_loss, mismatch_weights, ppo_clip_loss
from megaflow.flow.schedule import sd3_sigmas
from megaflow.flow.step import TransitionConfig, sigma_max_of, step, transition_log_prob

torch.set_num_threads(1)
MASK = torch.tensor([True, False, True, True, False])


def _poison(t: torch.Tensor, values=(math.nan, -math.inf)) -> torch.Tensor:
    t = t.clone()
    for j, idx in enumerate((~MASK).nonzero().flatten().tolist()):
        t[idx] = values[j % len(values)]
    return t


def _case():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(5, generator=g) * 1e-3, torch.randn(5, generator=g) * 1e-3, torch.randn(5, generator=g),
            torch.rand(5, generator=g) + 0.5)


@pytest.mark.parametrize("normalizer", [None, 7.0])
def test_ppo_clip_ignores_nan_and_inf_in_masked_entries(normalizer):
    lp, old, adv, w = _case()
    clean_lp = lp.clone().requires_grad_(True)
    clean, clean_stats = ppo_clip_loss(clean_lp, old, adv, clip_range=1e-4, mask=MASK, weights=w,
                                       normalizer=normalizer)
    clean.backward()
    bad_lp = _poison(lp, (-math.inf, math.nan)).requires_grad_(True)
    bad, bad_stats = ppo_clip_loss(bad_lp, _poison(old), _poison(adv, (math.inf, math.nan)), clip_range=1e-4,
                                   mask=MASK, weights=_poison(w), normalizer=normalizer)
    bad.backward()
    assert torch.isfinite(bad) and bad.item() == clean.item()
    assert torch.equal(bad_lp.grad, clean_lp.grad) and bool((bad_lp.grad[~MASK] == 0).all())
    for k, v in clean_stats.items():
        assert torch.equal(bad_stats[k], v), k


def test_normalizer_is_sum_over_kept_divided_by_n():
    lp, old, adv, _ = _case()
    mean, _ = ppo_clip_loss(lp, old, adv, clip_range=1e-4, mask=MASK)
    summed, stats = ppo_clip_loss(lp, old, adv, clip_range=1e-4, mask=MASK, normalizer=10.0)
    torch.testing.assert_close(summed, mean * int(MASK.sum()) / 10.0, rtol=1e-6, atol=0)
    assert stats["policy_loss"].item() == pytest.approx(mean.item(), rel=1e-6)  # stats stay means
    with pytest.raises(ValueError, match="normalizer"):
        ppo_clip_loss(lp, old, adv, clip_range=1e-4, normalizer=0.0)


def _steps(kind="sde"):
    """A batch of 5 recomputed steps (rows 1 and 4 masked) from a tiny linear velocity."""
    sigmas = sd3_sigmas(4)
    cfg = TransitionConfig(kind=kind, noise_level=0.7, no_const=kind == "cps")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 2, 2, generator=g)
    lin = torch.nn.Linear(2, 2)
    with torch.no_grad():
        rolled = step(x, lin(x), sigmas[1], sigmas[2], sigma_max=sigma_max_of(sigmas), config=cfg,
                      noise=torch.randn(x.shape, generator=g))
        ref_mean = rolled.mean + 0.01 * torch.randn(x.shape, generator=g)
    return lin, x, rolled, ref_mean, dict(sigma=sigmas[1], sigma_next=sigmas[2], sigma_max=sigma_max_of(sigmas),
                                          config=cfg)


@pytest.mark.parametrize("normalizer", [None, 9.0])
def test_kl_and_total_loss_ignore_nan_in_masked_entries(normalizer):
    lin, x, rolled, ref_mean, args = _steps()
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.5])
    loss_cfg = LossConfig(clip_range=1e-4, kl_beta=0.04)
    results = []
    for poisoned in (False, True):
        lin.zero_grad()
        policy = transition_log_prob(x, lin(x), rolled.sample, **args)
        old = _poison(rolled.log_prob) if poisoned else rolled.log_prob
        a = _poison(adv, (math.nan, math.inf)) if poisoned else adv
        ref = ref_mean.clone()
        if poisoned:
            ref[~MASK] = math.nan
        loss, stats = flow_grpo_loss(policy, old_log_prob=old, advantages=a, config=loss_cfg, ref_mean=ref,
                                     mask=MASK, normalizer=normalizer)
        loss.backward()
        results.append((loss.detach(), stats, lin.weight.grad.clone()))
    (clean, clean_stats, clean_grad), (bad, bad_stats, bad_grad) = results
    assert torch.isfinite(bad) and torch.equal(bad, clean) and torch.equal(bad_grad, clean_grad)
    assert bad_stats["kl"].item() == clean_stats["kl"].item() > 0


def test_masked_deterministic_step_with_std_zero_stays_finite():
    """A masked CPS last step (σ' = 0: std 0) next to kept steps: the KL divides by a replaced std."""
    lin, x, rolled, ref_mean, args = _steps("cps")
    policy = transition_log_prob(x, lin(x), rolled.sample, **args)
    std0 = policy.std_dev_t.clone()
    std0[~MASK] = 0.0
    policy = type(policy)(sample=policy.sample, mean=policy.mean, std=policy.std, std_dev_t=std0,
                          log_prob=policy.log_prob)
    loss, stats = flow_grpo_loss(policy, old_log_prob=rolled.log_prob, advantages=torch.ones(5),
                                 config=LossConfig(clip_range=1e-5, kl_beta=0.04), ref_mean=ref_mean, mask=MASK)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(stats["kl"]) and torch.isfinite(lin.weight.grad).all()


def test_mismatch_weights_ignore_nan_in_masked_entries():
    train, rollout = torch.zeros(5), torch.full((5,), 0.1)
    for level in ("step", "trajectory", "geometric"):
        cfg = MismatchConfig(mismatch="mis", mismatch_level=level, mismatch_cap=2.0, mismatch_floor=0.5)
        clean = mismatch_weights(train[None], rollout[None], cfg, mask=MASK[None])
        bad = mismatch_weights(_poison(train)[None], _poison(rollout, (math.inf, math.nan))[None], cfg,
                               mask=MASK[None])
        assert torch.equal(bad.weights, clean.weights) and torch.equal(bad.keep, clean.keep)
        assert all(torch.isfinite(v) for v in bad.stats.values())
