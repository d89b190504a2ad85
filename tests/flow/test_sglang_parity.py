"""megaflow.flow equals SGLang's own rollout math (sglang 0.5.23 FlowRolloutController) to <= 1e-6.

We call the engine's controller (``flow_sde_sampling``, debug mode on, one generator per sample as the
engine does) on random latents and compare sample, mean, std and the per-step log-prob with ours, over
sde/cps/ode, with and without constants, several shapes and noise levels, the first step (σ = 1) and the
last (σ' = 0), and an SDE window. Also: the engine's scheduler grid equals ``sd3_sigmas``.

Needs: CPU, 1 process; imports sglang (10-35 s once on a loaded 2-core machine), no engine process.
"""
import pytest
import torch

import megaflow  # noqa: F401  (flash_mla guard before sglang)
from sglang.multimodal_gen.runtime.models.schedulers.scheduling_flow_match_euler_discrete import (
    FlowMatchEulerDiscreteScheduler as SglScheduler,
)
from sglang.multimodal_gen.runtime.post_training.flow_rollout_controller import FlowRolloutController

from megaflow.flow.schedule import sd3_sigmas
from megaflow.flow.step import TransitionConfig, config_for_step, sigma_max_of, step, transition_log_prob

torch.set_num_threads(1)
TOL = dict(atol=1e-6, rtol=0)


def _controller(sigmas, shape, cfg, seed, sde_step_indices=None):
    """The controller the engine's denoising stage builds for one request (single rank, no SP)."""
    return FlowRolloutController(
        sde_type=cfg.kind, noise_level=cfg.noise_level, log_prob_no_const=cfg.no_const, debug_mode=True,
        sde_step_indices=sde_step_indices, generator=[torch.Generator().manual_seed(seed)],
        return_dit_trajectory=False, return_step_indices=None,
        shard_for_sp=lambda batch, x: x, gather_for_sp=lambda batch, x: x,
        sigmas=sigmas, latents_shape=tuple(shape))


def _sglang_step(ctl, x, v, sigmas, i):
    """One engine step; returns (x', mean, std [1], log_prob [1])."""
    nxt = ctl.flow_sde_sampling(batch=None, model_output=v, sample=x, current_sigma=sigmas[i],
                                next_sigma=sigmas[i + 1], step_index=i)
    _, mean, std, _ = ctl.consume_local_rollout_debug_tensors()
    log_prob = ctl.collect_rollout_log_probs()[:, 0]
    return nxt, mean[:, 0], std[:, 0, 0], log_prob


@pytest.mark.parametrize("num_steps", [4, 10])
def test_engine_scheduler_grid_equals_sd3_sigmas(num_steps):
    scheduler = SglScheduler(shift=3.0)
    scheduler.set_timesteps(num_steps)
    assert torch.equal(scheduler.sigmas, sd3_sigmas(num_steps, shift=3.0))


CASES = [
    ("sde", 0.7, False), ("sde", 0.7, True), ("sde", 0.5, False), ("sde", 1.0, True),
    ("cps", 0.8, True), ("cps", 0.8, False), ("cps", 0.5, True), ("ode", 0.7, True),
]
SHAPES = [(1, 4, 8, 8), (1, 16, 3), (1, 2, 3, 4, 5)]


@pytest.mark.parametrize("kind,level,no_const", CASES)
@pytest.mark.parametrize("shape", SHAPES)
def test_every_step_matches_engine(kind, level, no_const, shape):
    cfg = TransitionConfig(kind=kind, noise_level=level, no_const=no_const)
    sigmas = sd3_sigmas(5, shift=3.0)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=g)
    for i in range(len(sigmas) - 1):
        v = torch.randn(shape, generator=g)
        ctl = _controller(sigmas, shape, cfg, seed=100 + i)
        last_cps_const = kind == "cps" and not no_const and i == len(sigmas) - 2
        if last_cps_const:
            # The engine returns NaN at σ' = 0 with constants; we refuse it loudly instead.
            _, _, _, lp = _sglang_step(ctl, x, v, sigmas, i)
            assert bool(torch.isnan(lp).all())
            with pytest.raises(ValueError, match="sigma_next=0"):
                step(x, v, sigmas[i], sigmas[i + 1], sigma_max=sigma_max_of(sigmas), config=cfg,
                     generator=[torch.Generator().manual_seed(100 + i)])
            continue
        ref_next, ref_mean, ref_std, ref_lp = _sglang_step(ctl, x, v, sigmas, i)
        ours = step(x, v, sigmas[i], sigmas[i + 1], sigma_max=sigma_max_of(sigmas), config=cfg,
                    generator=[torch.Generator().manual_seed(100 + i)])
        torch.testing.assert_close(ours.sample, ref_next, **TOL)
        torch.testing.assert_close(ours.mean, ref_mean, **TOL)
        torch.testing.assert_close(ours.std, ref_std.expand(1), **TOL)
        torch.testing.assert_close(ours.log_prob, ref_lp, **TOL)
        # The trainer's recomputation from the stored x' (residual x' − μ instead of std·ε).
        again = transition_log_prob(x, v, ref_next, sigmas[i], sigmas[i + 1], sigma_max=sigma_max_of(sigmas),
                                    config=cfg)
        torch.testing.assert_close(again.log_prob, ref_lp, atol=5e-5 if not no_const else 1e-6, rtol=1e-6)
        x = ref_next


@pytest.mark.parametrize("kind,no_const", [("sde", False), ("cps", True)])
def test_sde_window_trajectory_matches_engine(kind, no_const):
    """Steps outside rollout_sde_step_indices are ODE with log-prob 0 and draw no noise."""
    cfg = TransitionConfig(kind=kind, noise_level=0.7, no_const=no_const)
    sigmas, window, shape = sd3_sigmas(6), [1, 2, 4], (1, 4, 4, 4)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(shape, generator=g)
    velocities = [torch.randn(shape, generator=g) for _ in range(6)]
    ctl = _controller(sigmas, shape, cfg, seed=42, sde_step_indices=window)
    ours_gen = [torch.Generator().manual_seed(42)]
    x_ref, x_ours, ours_lps = x0, x0, []
    for i, v in enumerate(velocities):
        x_ref = ctl.flow_sde_sampling(batch=None, model_output=v, sample=x_ref, current_sigma=sigmas[i],
                                      next_sigma=sigmas[i + 1], step_index=i)
        out = step(x_ours, v, sigmas[i], sigmas[i + 1], sigma_max=sigma_max_of(sigmas),
                   config=config_for_step(cfg, i, window), generator=ours_gen)
        x_ours = out.sample
        ours_lps.append(out.log_prob)
        torch.testing.assert_close(x_ours, x_ref, **TOL)
    ref_lps = ctl.collect_rollout_log_probs()
    torch.testing.assert_close(torch.stack(ours_lps, dim=1), ref_lps, **TOL)
    assert all(ref_lps[0, i] == 0 for i in range(6) if i not in window)


def test_batched_per_sample_sigmas_match_engine_per_request():
    """One batched call with per-sample σ ([B]) and one generator per sample == B engine requests."""
    cfg = TransitionConfig(kind="sde", noise_level=0.7)
    sigmas = sd3_sigmas(4)
    steps = torch.tensor([0, 1, 3])
    g = torch.Generator().manual_seed(1)
    x, v = torch.randn(3, 4, 4, 4, generator=g), torch.randn(3, 4, 4, 4, generator=g)
    ours = step(x, v, sigmas[steps], sigmas[steps + 1], sigma_max=sigma_max_of(sigmas), config=cfg,
                generator=[torch.Generator().manual_seed(s) for s in (5, 6, 7)])
    for b, i in enumerate(steps.tolist()):
        ctl = _controller(sigmas, (1, 4, 4, 4), cfg, seed=5 + b)
        ref_next, _, _, ref_lp = _sglang_step(ctl, x[b:b + 1], v[b:b + 1], sigmas, i)
        torch.testing.assert_close(ours.sample[b:b + 1], ref_next, **TOL)
        torch.testing.assert_close(ours.log_prob[b:b + 1], ref_lp, **TOL)
