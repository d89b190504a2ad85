"""Flow transitions against hand/float64 formulas, torch.distributions, batching and SDE-window rules.

Needs: CPU, 1 process (torch only). Parity with SGLang's own controller is in test_sglang_parity.py.
"""
import math

import pytest
import torch

import megaflow  # noqa: F401
from megaflow.flow.schedule import sd3_sigmas
from megaflow.flow.step import (
    TransitionConfig,
    config_for_step,
    gaussian_log_prob,
    sde_step_mask,
    sigma_max_of,
    step,
    transition_log_prob,
)

torch.set_num_threads(1)
SIGMAS = sd3_sigmas(4, shift=3.0)
SIGMA_MAX = sigma_max_of(SIGMAS)


def _xv(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _reference_sde(x, v, eps, sig, sig_next, sig_max, a):
    """The conventions of megaflow.flow.step (its module docstring) in float64, written independently of step.py."""
    x, v, eps = x.double(), v.double(), eps.double()
    sig_t = sig_max if abs(sig - 1.0) < 1e-6 else sig
    s = a * math.sqrt(sig / (1 - sig_t))
    dt = sig_next - sig
    std = s * math.sqrt(-dt)
    mean = x * (1 + s * s * dt / (2 * sig)) + v * (1 + s * s * (1 - sig) / (2 * sig)) * dt
    return mean, std, mean + std * eps


@pytest.mark.parametrize("index", [0, 1, 3])
def test_sde_step_matches_float64_formula(index):
    x, v, eps = _xv((2, 3, 4, 4))
    sig, nxt, smax = SIGMAS[index].item(), SIGMAS[index + 1].item(), SIGMA_MAX.item()
    cfg = TransitionConfig(kind="sde", noise_level=0.7)
    out = step(x, v, SIGMAS[index], SIGMAS[index + 1], sigma_max=SIGMA_MAX, config=cfg, noise=eps)
    mean, std, sample = _reference_sde(x, v, eps, sig, nxt, smax, 0.7)
    torch.testing.assert_close(out.mean.double(), mean, atol=2e-6, rtol=0)
    torch.testing.assert_close(out.sample.double(), sample, atol=2e-6, rtol=0)
    assert out.std.shape == (2,) and torch.allclose(out.std.double(), torch.full((2,), std, dtype=torch.float64))
    expected_lp = torch.distributions.Normal(mean, std).log_prob(sample).mean(dim=(1, 2, 3))
    torch.testing.assert_close(out.log_prob.double(), expected_lp, atol=1e-5, rtol=0)


def test_cps_step_matches_formula():
    x, v, eps = _xv((3, 8))
    sig, nxt = 0.6, 0.4
    cfg = TransitionConfig(kind="cps", noise_level=0.8, no_const=True)
    out = step(x, v, sig, nxt, sigma_max=SIGMA_MAX, config=cfg, noise=eps)
    std = nxt * math.sin(0.8 * math.pi / 2)
    mean = (1 - nxt) * (x - sig * v) + math.sqrt(nxt**2 - std**2) * (x + (1 - sig) * v)
    torch.testing.assert_close(out.mean, mean.float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(out.sample, (mean + std * eps).float(), atol=1e-6, rtol=0)
    torch.testing.assert_close(out.log_prob, -((std * eps) ** 2).mean(dim=1).float(), atol=1e-6, rtol=0)
    assert torch.allclose(out.std, out.std_dev_t)


@pytest.mark.parametrize("kind,no_const", [("sde", False), ("sde", True), ("cps", False), ("cps", True)])
def test_recomputed_log_prob_equals_sampling_log_prob(kind, no_const):
    cfg = TransitionConfig(kind=kind, noise_level=0.7, no_const=no_const)
    x, v, eps = _xv((2, 4, 6, 6), seed=3)
    for i in range(len(SIGMAS) - 1):
        if kind == "cps" and not no_const and i == len(SIGMAS) - 2:
            continue  # undefined there (tested below)
        out = step(x, v, SIGMAS[i], SIGMAS[i + 1], sigma_max=SIGMA_MAX, config=cfg, noise=eps)
        again = transition_log_prob(x, v, out.sample, SIGMAS[i], SIGMAS[i + 1], sigma_max=SIGMA_MAX, config=cfg)
        torch.testing.assert_close(again.log_prob, out.log_prob, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(again.mean, out.mean, atol=0, rtol=0)


def test_log_prob_with_constants_is_gaussian_density():
    mean = torch.randn(3, 5)
    std = torch.tensor([0.1, 0.5, 2.0]).view(3, 1)
    x = mean + std * torch.randn(3, 5)
    expected = torch.distributions.Normal(mean, std).log_prob(x).mean(dim=1)
    torch.testing.assert_close(gaussian_log_prob(x, mean, std, no_const=False), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(gaussian_log_prob(x, mean, std, no_const=True), -((x - mean) ** 2).mean(1))


def test_per_sample_sigmas_equal_per_sample_loop():
    x, v, eps = _xv((3, 2, 5))
    idx = torch.tensor([0, 2, 3])
    cfg = TransitionConfig(kind="sde")
    batched = step(x, v, SIGMAS[idx], SIGMAS[idx + 1], sigma_max=SIGMA_MAX, config=cfg, noise=eps)
    for b in range(3):
        single = step(x[b:b + 1], v[b:b + 1], SIGMAS[idx[b]], SIGMAS[idx[b] + 1], sigma_max=SIGMA_MAX,
                      config=cfg, noise=eps[b:b + 1])
        torch.testing.assert_close(batched.sample[b:b + 1], single.sample, atol=0, rtol=0)
        torch.testing.assert_close(batched.log_prob[b:b + 1], single.log_prob, atol=1e-7, rtol=0)
        torch.testing.assert_close(batched.std[b:b + 1], single.std, atol=0, rtol=0)


def test_generators_reproduce_and_list_draws_per_sample():
    x, v, _ = _xv((2, 3, 4))
    cfg = TransitionConfig(kind="sde")
    gens = [torch.Generator().manual_seed(s) for s in (11, 12)]
    out = step(x, v, 0.5, 0.25, sigma_max=SIGMA_MAX, config=cfg, generator=gens)
    eps = torch.cat([torch.randn((1, 3, 4), generator=torch.Generator().manual_seed(s)) for s in (11, 12)])
    same = step(x, v, 0.5, 0.25, sigma_max=SIGMA_MAX, config=cfg, noise=eps)
    assert torch.equal(out.sample, same.sample)
    one = step(x, v, 0.5, 0.25, sigma_max=SIGMA_MAX, config=cfg, generator=torch.Generator().manual_seed(5))
    two = step(x, v, 0.5, 0.25, sigma_max=SIGMA_MAX, config=cfg, generator=torch.Generator().manual_seed(5))
    assert torch.equal(one.sample, two.sample) and not torch.equal(one.sample, out.sample)
    with pytest.raises(ValueError):
        step(x, v, 0.5, 0.25, sigma_max=SIGMA_MAX, config=cfg)  # neither noise nor generator
    with pytest.raises(ValueError):
        step(x, v, 0.5, 0.25, sigma_max=SIGMA_MAX, config=cfg, generator=gens[:1])
    with pytest.raises(ValueError, match="sigma_next must be < sigma"):
        step(x, v, 0.25, 0.5, sigma_max=SIGMA_MAX, config=cfg, generator=gens)
    with pytest.raises(ValueError, match="shape"):
        step(x, v, torch.tensor([0.5, 0.4, 0.3]), 0.25, sigma_max=SIGMA_MAX, config=cfg, generator=gens)


def test_ode_step_is_euler_with_zero_log_prob_and_draws_nothing():
    x, v, _ = _xv((2, 6))
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    out = step(x, v, 0.6, 0.4, sigma_max=SIGMA_MAX, config=TransitionConfig(kind="ode"), generator=g)
    assert torch.equal(g.get_state(), state)
    torch.testing.assert_close(out.sample, x + (0.4 - 0.6) * v)
    assert torch.equal(out.log_prob, torch.zeros(2)) and torch.equal(out.std, torch.zeros(2))


def test_cps_terminal_step():
    x, v, eps = _xv((2, 4))
    with pytest.raises(ValueError, match="sigma_next=0"):
        step(x, v, 0.25, 0.0, sigma_max=SIGMA_MAX, config=TransitionConfig(kind="cps"), noise=eps)
    with pytest.raises(ValueError, match="sigma_next=0"):
        transition_log_prob(x, v, x, 0.25, 0.0, sigma_max=SIGMA_MAX, config=TransitionConfig(kind="cps"))
    out = step(x, v, 0.25, 0.0, sigma_max=SIGMA_MAX, config=TransitionConfig(kind="cps", no_const=True),
               noise=eps)
    torch.testing.assert_close(out.sample, x - 0.25 * v)  # deterministic: the x0 prediction
    assert torch.equal(out.log_prob, torch.zeros(2))


def test_sde_first_and_last_steps_are_finite():
    x, v, eps = _xv((2, 4))
    cfg = TransitionConfig(kind="sde")
    for i in (0, len(SIGMAS) - 2):
        out = step(x, v, SIGMAS[i], SIGMAS[i + 1], sigma_max=SIGMA_MAX, config=cfg, noise=eps)
        assert bool(torch.isfinite(out.sample).all() and torch.isfinite(out.log_prob).all())
    # σ = 1 uses sigma_max = sigmas[1] in place of σ inside 1 − σ̃.
    first = step(x, v, 1.0, SIGMAS[1], sigma_max=SIGMA_MAX, config=cfg, noise=eps)
    assert first.std_dev_t[0].item() == pytest.approx(0.7 * math.sqrt(1 / (1 - SIGMA_MAX.item())), rel=1e-6)


def test_recomputed_log_prob_is_differentiable_in_velocity_only():
    x, v, eps = _xv((2, 4))
    v = v.requires_grad_()
    x_next = x.clone().requires_grad_()
    cfg = TransitionConfig(kind="sde")
    out = transition_log_prob(x, v, x_next, 0.5, 0.25, sigma_max=SIGMA_MAX, config=cfg)
    out.log_prob.sum().backward()
    assert v.grad is not None and bool(v.grad.abs().sum() > 0)
    assert x_next.grad is None


def test_sde_step_mask_and_effective_config():
    assert sde_step_mask(4).tolist() == [True] * 4
    assert sde_step_mask(4, [1, 2]).tolist() == [False, True, True, False]
    assert sde_step_mask(4, []).tolist() == [False] * 4
    with pytest.raises(ValueError):
        sde_step_mask(4, [4])
    cfg = TransitionConfig(kind="cps", noise_level=0.8, no_const=True)
    assert config_for_step(cfg, 1, [1, 2]) is cfg
    assert config_for_step(cfg, 0, [1, 2]).kind == "ode"
    assert config_for_step(cfg, 3, None) is cfg


@pytest.mark.parametrize("kwargs", [dict(kind="euler"), dict(noise_level=-0.1), dict(noise_level=0.0),
                                    dict(noise_level=float("nan"))])
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        TransitionConfig(**kwargs)


def test_video_log_prob_reduces_over_the_frame_axis():
    """A video step [B, C, F, H, W]: the log-prob is the Gaussian log-density averaged over every element, frames
    included (independent: per-frame densities by hand, then the mean of the frames' means), and changing one frame
    of one sample changes only that sample's log-prob."""
    import math

    from megaflow.flow.step import TransitionConfig, transition_log_prob, transition_mean_std

    g = torch.Generator().manual_seed(3)
    x, v, x_next = (torch.randn(2, 4, 3, 4, 6, generator=g) for _ in range(3))
    config = TransitionConfig(kind="sde", noise_level=0.7)
    lp = transition_log_prob(x, v, x_next, 0.8, 0.6, sigma_max=0.9, config=config).log_prob
    mean, std, _ = transition_mean_std(x, v, 0.8, 0.6, sigma_max=0.9, config=config)
    density = -((x_next - mean) ** 2) / (2 * std ** 2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    per_frame = torch.stack([density[:, :, f].mean(dim=(1, 2, 3)) for f in range(3)], dim=1)  # [B, F]
    torch.testing.assert_close(lp, per_frame.mean(dim=1), rtol=0, atol=1e-6)
    moved = x_next.clone()
    moved[1, :, 2] += 1.0
    lp2 = transition_log_prob(x, v, moved, 0.8, 0.6, sigma_max=0.9, config=config).log_prob
    assert lp2[0] == lp[0] and lp2[1] < lp[1]
