"""Sigma grids for flow-matching sampling: pure functions. σ = 1 is noise, σ = 0 data; a grid of N steps is a
strictly decreasing fp32 ``[N + 1]`` ending in exactly 0. Design notes: docs/design/flow.md.
"""
from __future__ import annotations

import math

import torch

__all__ = [
    "shift_sigmas",
    "time_shift_exponential",
    "sd3_sigmas",
    "flux_mu",
    "flux_sigmas",
    "check_sigmas",
    "timesteps_from_sigmas",
]


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3/Flux static shift ``σ ↦ shift·σ / (1 + (shift − 1)·σ)`` (diffusers' FlowMatchEulerDiscreteScheduler)."""
    if not (shift > 0 and math.isfinite(shift)):
        raise ValueError(f"shift must be a positive finite number, got {shift!r}")
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def time_shift_exponential(sigmas: torch.Tensor, mu: float, exponent: float = 1.0) -> torch.Tensor:
    """Flux shift ``σ ↦ e^μ / (e^μ + (1/σ − 1)^exponent)``, σ > 0, rounded as diffusers' numpy arithmetic."""
    e_mu = torch.full_like(sigmas, math.exp(mu))
    return e_mu / (e_mu + (1 / sigmas - 1) ** exponent)


def _check_num_steps(num_steps: int) -> None:
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")


def _linspace64(start: float, stop: float, num: int) -> torch.Tensor:
    """float64 ``start + i * (stop - start) / (num - 1)``, last point ``stop``: numpy.linspace's arithmetic."""
    if num == 1:
        return torch.tensor([start], dtype=torch.float64)
    grid = torch.arange(num, dtype=torch.float64) * ((stop - start) / (num - 1)) + start
    grid[-1] = stop
    return grid


def sd3_sigmas(num_steps: int, *, shift: float = 3.0, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The ``[num_steps + 1]`` fp32 grid of diffusers' FlowMatchEulerDiscreteScheduler(shift=shift), terminal 0."""
    _check_num_steps(num_steps)
    if num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be >= 1, got {num_train_timesteps!r}")
    # The scheduler's training grid is fp32 and shifted in fp32; its ends are read back with .item().
    one = torch.ones(1, dtype=torch.float32)
    sigma_max = shift_sigmas(one, shift).item()
    sigma_min = shift_sigmas(one / num_train_timesteps, shift).item()
    # set_timesteps: float64 linspace of timesteps, / num_train, shift again in float64, then fp32.
    timesteps = _linspace64(sigma_max * num_train_timesteps, sigma_min * num_train_timesteps, num_steps)
    sigmas = shift_sigmas(timesteps / num_train_timesteps, shift).to(torch.float32)
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float32)])


def flux_mu(image_seq_len: int, *, base_seq_len: int = 256, max_seq_len: int = 4096,
            base_shift: float = 0.5, max_shift: float = 1.15) -> float:
    """Flux's μ: linear in the number of latent tokens, from ``base_shift`` at ``base_seq_len`` to
    ``max_shift`` at ``max_seq_len`` (diffusers ``calculate_shift``)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + base_shift - slope * base_seq_len


def flux_sigmas(num_steps: int, *, mu: float) -> torch.Tensor:
    """The ``[num_steps + 1]`` fp32 grid of the diffusers Flux pipeline (dynamic shifting with ``mu``)."""
    _check_num_steps(num_steps)
    base = _linspace64(1.0, 1.0 / num_steps, num_steps).to(torch.float32)
    sigmas = time_shift_exponential(base, mu)
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float32)])


def check_sigmas(sigmas: torch.Tensor) -> None:
    """Raise ValueError unless ``sigmas`` is a 1-D grid in [0, 1], strictly decreasing, ending at 0."""
    if sigmas.dim() != 1 or sigmas.numel() < 2:
        raise ValueError(f"sigmas must be 1-D with at least 2 entries, got shape {tuple(sigmas.shape)}")
    if float(sigmas[-1]) != 0.0:
        raise ValueError(f"sigmas must end at 0 (terminal), got last entry {float(sigmas[-1])!r}")
    if float(sigmas.max()) > 1.0 or float(sigmas.min()) < 0.0:
        raise ValueError(f"sigmas must lie in [0, 1], got range [{float(sigmas.min())}, {float(sigmas.max())}]")
    if not bool((sigmas[1:] < sigmas[:-1]).all()):
        raise ValueError(f"sigmas must be strictly decreasing, got {sigmas.tolist()}")


def timesteps_from_sigmas(sigmas: torch.Tensor, num_train_timesteps: int = 1000) -> torch.Tensor:
    """DiT timesteps of the N steps of a grid: ``sigmas[:-1] * num_train_timesteps`` (diffusers convention)."""
    return sigmas[:-1] * num_train_timesteps
