"""FlowGRPO loss, KL and TIS/MIS weights on hand-computed cases; gradients through a tiny real velocity
model (nn.Linear) for the PPO clip and the KL. Needs: CPU, 1 process (torch only).
"""
import math

import pytest
import torch

import megaflow  # noqa: F401
from megaflow.algo.flowgrpo import (
    LossConfig,
    MismatchConfig,
    flow_grpo_loss,
    gaussian_kl,
    mismatch_weights,
    ppo_clip_loss,
    train_step_indices,
)
from megaflow.flow.schedule import sd3_sigmas
from megaflow.flow.step import StepResult, TransitionConfig, sigma_max_of, step, transition_log_prob

torch.set_num_threads(1)


def test_ppo_clip_hand_values():
    ratio = torch.tensor([1.0, 1.5, 0.5, 1.00005])
    log_prob = ratio.log()
    adv = torch.tensor([1.0, 1.0, -1.0, 2.0])
    loss, stats = ppo_clip_loss(log_prob, torch.zeros(4), adv, clip_range=0.2)
    # per sample: max(-A·ρ, -A·clip(ρ)) = -1, max(-1.5, -1.2), max(0.5, 0.8), -2.0001
    assert loss.item() == pytest.approx((-1.0 - 1.2 + 0.8 - 2.0001) / 4, abs=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(0.5)
    assert stats["approx_kl"].item() == pytest.approx(0.5 * (math.log(1.5) ** 2 + math.log(0.5) ** 2) / 4, abs=1e-7)
    assert stats["ratio_max"].item() == pytest.approx(1.5) and stats["ratio_min"].item() == pytest.approx(0.5)
    assert stats["ratio_mean"].item() == pytest.approx((1 + 1.5 + 0.5 + 1.00005) / 4, abs=1e-6)


@pytest.mark.parametrize("adv,ratio,zero_grad", [
    (1.0, 1.5, True),    # A > 0, ρ > 1 + ε: clipped, no gradient
    (1.0, 0.5, False),   # A > 0, ρ < 1 − ε: unclipped branch is the max, gradient flows
    (-1.0, 0.5, True),   # A < 0, ρ < 1 − ε: clipped
    (-1.0, 1.5, False),  # A < 0, ρ > 1 + ε: gradient flows
    (1.0, 1.1, False),   # inside the clip region
    (-2.0, 0.9, False),
])
def test_ppo_gradient_is_zero_exactly_outside_the_clip_region(adv, ratio, zero_grad):
    log_prob = torch.tensor([math.log(ratio)], requires_grad=True)
    loss, _ = ppo_clip_loss(log_prob, torch.zeros(1), torch.tensor([adv]), clip_range=0.2)
    loss.backward()
    if zero_grad:
        assert log_prob.grad.item() == 0.0
    else:  # d/dlogp (−A·e^logp) = −A·ρ
        assert log_prob.grad.item() == pytest.approx(-adv * ratio, rel=1e-6)


def test_mask_and_weights():
    log_prob = torch.tensor([[0.1, 0.3], [-0.2, 0.05]], requires_grad=True)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, False], [True, True]])
    loss, _ = ppo_clip_loss(log_prob, torch.zeros(2, 2), adv, clip_range=0.5, mask=mask)
    manual = (-math.exp(0.1) + math.exp(-0.2) + math.exp(0.05)) / 3
    assert loss.item() == pytest.approx(manual, abs=1e-6)
    loss.backward()
    assert log_prob.grad[0, 1].item() == 0.0
    w = torch.tensor([[2.0, 1.0], [0.5, 1.0]])
    weighted, _ = ppo_clip_loss(log_prob.detach(), torch.zeros(2, 2), adv, clip_range=0.5, mask=mask, weights=w)
    assert weighted.item() == pytest.approx((-2 * math.exp(0.1) + 0.5 * math.exp(-0.2) + math.exp(0.05)) / 3, abs=1e-6)
    ones, _ = ppo_clip_loss(log_prob.detach(), torch.zeros(2, 2), adv, clip_range=0.5, mask=mask,
                            weights=torch.ones(2, 2))
    assert ones.item() == pytest.approx(loss.item(), abs=0)


def test_gaussian_kl_hand_and_exact():
    mean = torch.zeros(2, 3, 4)
    ref = torch.full((2, 3, 4), 0.1)
    std = torch.tensor([0.5, 0.25])
    kl = gaussian_kl(mean, ref, std)
    torch.testing.assert_close(kl, torch.tensor([0.01 / 0.5, 0.01 / 0.125]))
    assert torch.equal(gaussian_kl(ref, ref, std), torch.zeros(2))
    # It is the exact KL of the two step Gaussians (same std), averaged over elements.
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    exact = torch.distributions.kl_divergence(torch.distributions.Normal(a, std.view(2, 1)),
                                              torch.distributions.Normal(b, std.view(2, 1))).mean(1)
    torch.testing.assert_close(gaussian_kl(a, b, std), exact, atol=1e-6, rtol=1e-6)


class _TinyVelocity(torch.nn.Module):
    """A real (tiny) velocity model: v = Linear(x)·(1 + σ)."""

    def __init__(self, dim: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.lin = torch.nn.Linear(dim, dim)

    def forward(self, x, sigma):
        return self.lin(x) * (1 + sigma)


def _rollout_step(model, cfg, i, sigmas, batch=4, dim=6):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(batch, dim, generator=g)
    with torch.no_grad():
        out = step(x, model(x, sigmas[i]), sigmas[i], sigmas[i + 1], sigma_max=sigma_max_of(sigmas), config=cfg,
                   noise=torch.randn(batch, dim, generator=g))
    return x, out


@pytest.mark.parametrize("kl_std", ["flow_grpo", "transition"])
def test_flow_grpo_loss_total_and_kl_conventions(kl_std):
    sigmas = sd3_sigmas(4)
    cfg = TransitionConfig(kind="sde")
    policy, reference = _TinyVelocity(6, seed=0), _TinyVelocity(6, seed=1)
    x, old = _rollout_step(policy, cfg, 1, sigmas)
    adv = torch.tensor([1.0, -0.5, 0.25, 2.0])
    args = dict(sigma=sigmas[1], sigma_next=sigmas[2], sigma_max=sigma_max_of(sigmas), config=cfg)
    new = transition_log_prob(x, policy(x, sigmas[1]), old.sample, **args)
    with torch.no_grad():
        ref = transition_log_prob(x, reference(x, sigmas[1]), old.sample, **args)
    loss_cfg = LossConfig(clip_range=1e-4, kl_beta=0.04, kl_std=kl_std)
    loss, stats = flow_grpo_loss(new, old_log_prob=old.log_prob, advantages=adv, config=loss_cfg, ref_mean=ref.mean)
    # Same weights as the rollout: ratio 1 (to recomputation error), policy loss −mean(A).
    assert stats["ratio_max"].item() == pytest.approx(1.0, abs=1e-4)
    assert stats["policy_loss"].item() == pytest.approx(-adv.mean().item(), abs=1e-4)
    std = new.std_dev_t if kl_std == "flow_grpo" else new.std
    kl = (((new.mean - ref.mean) ** 2).mean(1) / (2 * std**2)).mean()
    assert stats["kl"].item() == pytest.approx(kl.item(), rel=1e-6) and kl.item() > 0
    assert loss.item() == pytest.approx(stats["policy_loss"].item() + 0.04 * kl.item(), rel=1e-6)
    # flow_grpo's KL omits the (−dt) factor of the transition variance.
    dt = (sigmas[2] - sigmas[1]).item()
    assert (new.std**2 / new.std_dev_t**2).mean().item() == pytest.approx(-dt, rel=1e-5)
    loss.backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in policy.parameters())
    # identical policies: KL exactly 0
    _, same = flow_grpo_loss(new, old_log_prob=old.log_prob, advantages=adv, config=loss_cfg,
                             ref_mean=new.mean.detach())
    assert same["kl"].item() == 0.0


def test_cps_loss_needs_terminal_step_masked():
    sigmas = sd3_sigmas(4)
    cfg = TransitionConfig(kind="cps", noise_level=0.8, no_const=True)
    model = _TinyVelocity(6, seed=0)
    x, old = _rollout_step(model, cfg, 3, sigmas)  # last step: σ' = 0, std 0
    new = transition_log_prob(x, model(x, sigmas[3]), old.sample, sigmas[3], sigmas[4],
                              sigma_max=sigma_max_of(sigmas), config=cfg)
    assert torch.equal(new.std, torch.zeros(4))
    loss_cfg = LossConfig(clip_range=LossConfig.auto_clip_range("cps", windowed=False))
    assert loss_cfg.clip_range == 1e-5
    with pytest.raises(ValueError, match="std 0"):
        flow_grpo_loss(new, old_log_prob=old.log_prob, advantages=torch.ones(4), config=loss_cfg,
                       ref_mean=new.mean.detach())
    no_kl = LossConfig(clip_range=1e-5, kl_beta=0.0)
    loss, stats = flow_grpo_loss(new, old_log_prob=old.log_prob, advantages=torch.ones(4), config=no_kl)
    assert "kl" not in stats and torch.isfinite(loss)
    with pytest.raises(ValueError, match="ref_mean"):
        flow_grpo_loss(new, old_log_prob=old.log_prob, advantages=torch.ones(4), config=LossConfig())


def test_mismatch_weights_step_level():
    train = torch.tensor([[0.1, -0.2, 0.0], [1.0, 0.0, 0.0]])
    rollout = torch.zeros(2, 3)
    tis = mismatch_weights(train, rollout, MismatchConfig(mismatch="tis", mismatch_cap=2.0))
    expected = torch.tensor([[math.exp(0.1), math.exp(-0.2), 1.0], [2.0, 1.0, 1.0]])
    torch.testing.assert_close(tis.weights, expected)
    assert tis.keep.all()
    assert tis.stats["is_frac_high"].item() == pytest.approx(1 / 6)
    assert tis.stats["is_weight_mean"].item() == pytest.approx(expected.mean().item(), rel=1e-6)
    lower = mismatch_weights(train, rollout, MismatchConfig(mismatch="tis", mismatch_cap=2.0, mismatch_floor=0.9))
    assert lower.weights[0, 1].item() == pytest.approx(0.9)
    assert lower.stats["is_frac_low"].item() == pytest.approx(1 / 6)
    mis = mismatch_weights(train, rollout, MismatchConfig(mismatch="mis", mismatch_cap=2.0, mismatch_floor=0.9))
    assert mis.keep.tolist() == [[True, False, True], [False, True, True]]
    torch.testing.assert_close(mis.weights, torch.tensor([[math.exp(0.1), 0.0, 1.0], [0.0, 1.0, 1.0]]))
    assert mis.stats["is_frac_rejected"].item() == pytest.approx(2 / 6)


def test_mismatch_weights_trajectory_and_geometric_levels():
    train = torch.tensor([[0.1, -0.2, 0.0], [1.0, 0.0, 0.0]])
    rollout = torch.zeros(2, 3)
    traj = mismatch_weights(train, rollout, MismatchConfig(mismatch_level="trajectory", mismatch_cap=2.0))
    torch.testing.assert_close(traj.weights, torch.tensor([[math.exp(-0.1)] * 3, [2.0] * 3]))
    geo = mismatch_weights(train, rollout, MismatchConfig(mismatch_level="geometric", mismatch_cap=2.0))
    torch.testing.assert_close(geo.weights, torch.tensor([[math.exp(-0.1 / 3)] * 3, [math.exp(1 / 3)] * 3]))
    # masked steps (outside the SDE window) are out of the aggregate and weigh 0
    mask = torch.tensor([[True, True, False], [False, True, True]])
    masked = mismatch_weights(train + torch.tensor([[0.0, 0.0, 5.0], [5.0, 0.0, 0.0]]), rollout,
                              MismatchConfig(mismatch_level="geometric", mismatch_cap=2.0), mask=mask)
    e0, e1 = math.exp(-0.1 / 2), 1.0
    torch.testing.assert_close(masked.weights, torch.tensor([[e0, e0, 0.0], [0.0, e1, e1]]))
    assert masked.keep.tolist() == mask.tolist()
    rej = mismatch_weights(train, rollout, MismatchConfig(mismatch="mis", mismatch_level="trajectory", mismatch_cap=2.0))
    assert rej.keep.tolist() == [[True] * 3, [False] * 3]


def test_train_step_indices():
    sde = TransitionConfig(kind="sde")
    cps = TransitionConfig(kind="cps", noise_level=0.8, no_const=True)
    assert train_step_indices(4, sde) == [0, 1, 2, 3]
    assert train_step_indices(4, sde, [1, 2]) == [1, 2]
    assert train_step_indices(4, cps) == [0, 1, 2]
    assert train_step_indices(4, cps, [2, 3]) == [2]
    with pytest.raises(ValueError):
        train_step_indices(4, cps, [3])
    with pytest.raises(ValueError):
        train_step_indices(4, TransitionConfig(kind="ode"))
    assert LossConfig.auto_clip_range("sde", windowed=True) == 1e-5
    assert LossConfig.auto_clip_range("sde", windowed=False) == 1e-4


@pytest.mark.parametrize("call", [
    lambda: LossConfig(clip_range=0.0),
    lambda: LossConfig(kl_beta=-1.0),
    lambda: LossConfig(kl_std="s2"),
    lambda: MismatchConfig(mismatch="clip"),
    lambda: MismatchConfig(mismatch_level="token"),
    lambda: MismatchConfig(mismatch_floor=2.0, mismatch_cap=2.0),
    lambda: ppo_clip_loss(torch.zeros(2), torch.zeros(3), torch.zeros(2), clip_range=0.1),
    lambda: ppo_clip_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), clip_range=0.1),
    lambda: gaussian_kl(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2)),
])
def test_bad_inputs_raise(call):
    with pytest.raises(ValueError):
        call()


def test_step_result_stack_over_steps():
    """Stacked [B, T] steps give the mean of the per-step losses (equal counts)."""
    g = torch.Generator().manual_seed(0)
    lp, old = torch.randn(3, 2, generator=g) * 0.01, torch.zeros(3, 2)
    adv = torch.tensor([1.0, -1.0, 0.5])
    stacked = StepResult(sample=torch.zeros(3, 2, 4), mean=torch.zeros(3, 2, 4), std=torch.ones(3, 2),
                         std_dev_t=torch.ones(3, 2), log_prob=lp)
    loss, _ = flow_grpo_loss(stacked, old_log_prob=old, advantages=adv, config=LossConfig(kl_beta=0.0, clip_range=0.2))
    per_step = [ppo_clip_loss(lp[:, t], old[:, t], adv, clip_range=0.2)[0] for t in range(2)]
    assert loss.item() == pytest.approx(sum(p.item() for p in per_step) / 2, abs=1e-7)
