"""Sigma grids equal diffusers' FlowMatchEulerDiscreteScheduler bit for bit. Needs: CPU, 1 process."""
import numpy as np
import pytest
import torch

import megaflow  # noqa: F401  (import guards before anything heavy)
from diffusers import FlowMatchEulerDiscreteScheduler

from megaflow.flow.schedule import (
    check_sigmas,
    flux_mu,
    flux_sigmas,
    sd3_sigmas,
    shift_sigmas,
    timesteps_from_sigmas,
)

torch.set_num_threads(1)


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
@pytest.mark.parametrize("num_steps", [1, 2, 4, 10, 28])
def test_sd3_sigmas_equal_diffusers(shift, num_steps):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps)
    ours = sd3_sigmas(num_steps, shift=shift)
    assert ours.dtype == torch.float32 and ours.shape == (num_steps + 1,)
    assert torch.equal(ours, scheduler.sigmas)
    assert torch.equal(timesteps_from_sigmas(ours), scheduler.timesteps)
    check_sigmas(ours)


def test_sd3_sigmas_last_step_is_double_shifted():
    """The diffusers quirk we reproduce: the last non-zero sigma is shift(shift(1/1000))."""
    once = shift_sigmas(torch.tensor(1e-3, dtype=torch.float64), 3.0)
    twice = shift_sigmas(once, 3.0)
    last = sd3_sigmas(4, shift=3.0)[-2].item()
    assert abs(last - twice.item()) < 1e-7
    assert abs(last - once.item()) > 1e-3


@pytest.mark.parametrize("num_steps", [1, 4, 10, 28])
@pytest.mark.parametrize("image_seq_len", [16, 256, 1024, 4096])
def test_flux_sigmas_equal_diffusers(num_steps, image_seq_len):
    mu = flux_mu(image_seq_len)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    scheduler.set_timesteps(num_steps, sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    assert torch.equal(flux_sigmas(num_steps, mu=mu), scheduler.sigmas)


def test_flux_mu_is_linear_between_base_and_max():
    assert flux_mu(256) == pytest.approx(0.5)
    assert flux_mu(4096) == pytest.approx(1.15)
    assert flux_mu(2176) == pytest.approx(0.825)


def test_shift_keeps_ends_and_moves_mass_to_high_noise():
    s = torch.linspace(0, 1, 11, dtype=torch.float64)
    shifted = shift_sigmas(s, 3.0)
    assert shifted[0] == 0 and shifted[-1] == 1
    assert bool((shifted[1:-1] > s[1:-1]).all())
    assert torch.equal(shift_sigmas(s, 1.0), s)


@pytest.mark.parametrize("bad", [
    torch.tensor([1.0, 0.5]),                 # no terminal 0
    torch.tensor([1.0, 0.5, 0.6, 0.0]),       # not decreasing
    torch.tensor([1.5, 0.5, 0.0]),            # outside [0, 1]
    torch.tensor([[1.0, 0.0]]),               # not 1-D
    torch.tensor([0.0]),                      # too short
])
def test_check_sigmas_rejects(bad):
    with pytest.raises(ValueError):
        check_sigmas(bad)


@pytest.mark.parametrize("kwargs", [dict(num_steps=0), dict(num_steps=2.0), dict(num_steps=4, shift=0.0)])
def test_bad_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        sd3_sigmas(**kwargs)
