"""One flow-matching transition x(σ) → x(σ') and its per-step log-probability: pure tensor functions, the
numbers SGLang's rollout produces (FlowGRPO's math), recomputable by the trainer. Design notes: docs/design/flow.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "KINDS",
    "TransitionConfig",
    "StepResult",
    "sigma_max_of",
    "transition_mean_std",
    "gaussian_log_prob",
    "step",
    "transition_log_prob",
    "sde_step_mask",
    "config_for_step",
]

KINDS = ("sde", "cps", "ode")
_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))  # the engine's constant, bit for bit


@dataclass(frozen=True, kw_only=True)
class TransitionConfig:
    """How one step moves from σ to σ'; mirrors the engine's rollout_sde_type / noise_level / no_const."""

    kind: str = "sde"
    """"sde" (FlowGRPO SDE), "cps" (coefficients-preserving sampling) or "ode" (deterministic Euler)."""
    noise_level: float = 0.7
    """a: SDE scale of s = a·sqrt(σ/(1−σ)); CPS angle std = σ'·sin(aπ/2). FlowGRPO: 0.7 SDE, 0.8 CPS."""
    no_const: bool = False
    """Log-prob −mean((x'−μ)²) instead of the Gaussian log-density (use with CPS)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        level = self.noise_level
        if isinstance(level, bool) or not isinstance(level, (int, float)) or not math.isfinite(level) or level < 0:
            raise ValueError(f"noise_level must be a finite number >= 0, got {level!r}")
        if self.kind != "ode" and not self.no_const and level == 0:
            raise ValueError("noise_level=0 has std 0: a log-prob with constants needs noise_level > 0")


@dataclass(frozen=True)
class StepResult:
    """Output of one transition; all fp32. ``std``/``std_dev_t``/``log_prob`` are ``[B]``."""

    sample: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    std_dev_t: torch.Tensor
    log_prob: torch.Tensor


def sigma_max_of(sigmas: torch.Tensor) -> torch.Tensor:
    """FlowGRPO/engine ``sigma_max`` of a grid ``[..., T+1]``: ``sigmas[..., 1]`` (``[..., 0]`` if T = 0)."""
    return sigmas[..., min(1, sigmas.shape[-1] - 1)]


def _as_sigma(value, x: torch.Tensor) -> torch.Tensor:
    """σ as fp32 on x's device, shaped to broadcast over ``x`` ([B] → [B, 1, ..., 1])."""
    t = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    if t.numel() == 1:
        return t.reshape(())
    if t.dim() != 1 or t.shape[0] != x.shape[0]:
        raise ValueError(f"sigma must be a scalar or shape [B]={x.shape[0]}, got shape {tuple(t.shape)}")
    return t.view(-1, *([1] * (x.dim() - 1)))


def _per_sample(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A scalar or [B, 1, ...] tensor as a [B] vector."""
    return t.reshape(-1).expand(x.shape[0]) if t.numel() == 1 else t.reshape(x.shape[0])


def _check_step(sigma, sigma_next, config: TransitionConfig) -> None:
    """User-facing checks of a step: σ' < σ, and no CPS-with-constants log-prob at σ' = 0."""
    sigma, sigma_next = torch.as_tensor(sigma), torch.as_tensor(sigma_next)
    if bool((sigma_next >= sigma).any()):
        raise ValueError(f"sigma_next must be < sigma (dt < 0), got sigma={sigma.tolist()} "
                         f"sigma_next={sigma_next.tolist()}")
    if config.kind == "cps" and not config.no_const and bool((sigma_next == 0).any()):
        raise ValueError("cps log-prob with constants is undefined at sigma_next=0 (std 0): "
                         "set no_const=True or keep the last step out of the SDE window")


def transition_mean_std(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, *, sigma_max,
                        config: TransitionConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """μ ``[B, ...]``, transition std and flow_grpo's std_dev_t (both broadcastable to x) of one step."""
    x = x.float()
    v = v.float()
    s_cur = _as_sigma(sigma, x)
    s_next = _as_sigma(sigma_next, x)
    dt = s_next - s_cur
    if config.kind == "sde":
        s_max = _as_sigma(sigma_max, x)
        near_one = torch.isclose(s_cur, torch.ones_like(s_cur))
        std_dev_t = torch.sqrt(s_cur / (1 - torch.where(near_one, s_max, s_cur))) * config.noise_level
        std = std_dev_t * torch.sqrt(-1 * dt)
        mean = (x * (1 + std_dev_t**2 / (2 * s_cur) * dt)
                + v * (1 + std_dev_t**2 * (1 - s_cur) / (2 * s_cur)) * dt)
    elif config.kind == "cps":
        std = s_next * math.sin(config.noise_level * math.pi / 2)
        std_dev_t = std
        x0_hat = x - s_cur * v
        x1_hat = x + v * (1 - s_cur)
        mean = x0_hat * (1 - s_next) + x1_hat * torch.sqrt(s_next**2 - std**2)
    else:
        mean = x + dt * v
        std = torch.zeros_like(dt)
        std_dev_t = std
    return mean, std, std_dev_t


def _log_prob_of_residual(residual: torch.Tensor, std: torch.Tensor, no_const: bool) -> torch.Tensor:
    sq = residual**2
    elem = -sq if no_const else -sq / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    return elem.mean(dim=tuple(range(1, elem.dim())))


def gaussian_log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, *,
                      no_const: bool) -> torch.Tensor:
    """Per-sample ``[B]`` mean over elements of log N(x_next; mean, std²), or −(x_next − mean)² if no_const.

    ``std`` broadcasts against ``mean`` (scalar or [B, 1, ...]). With constants std must be > 0.
    """
    return _log_prob_of_residual(x_next.float() - mean, std, no_const)


def _draw_noise(x: torch.Tensor, noise, generator) -> torch.Tensor:
    if (noise is None) == (generator is None):
        raise ValueError("pass exactly one of noise= or generator= for an sde/cps step")
    if noise is not None:
        if noise.shape != x.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} != latent shape {tuple(x.shape)}")
        return noise.to(device=x.device, dtype=torch.float32)
    def draw(shape, g):
        return torch.randn(shape, generator=g, device=g.device, dtype=torch.float32).to(x.device)

    if isinstance(generator, torch.Generator):
        return draw(x.shape, generator)
    if len(generator) != x.shape[0]:
        raise ValueError(f"need one generator per sample: got {len(generator)} for batch {x.shape[0]}")
    return torch.cat([draw((1, *x.shape[1:]), g) for g in generator])


def step(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, *, sigma_max, config: TransitionConfig,
         noise: torch.Tensor | None = None,
         generator: torch.Generator | Sequence[torch.Generator] | None = None) -> StepResult:
    """Sample x' for one step and its log-prob, as the engine does; sde/cps need exactly one of ``noise`` or
    ``generator`` (a list: one draw per sample). ODE draws nothing."""
    _check_step(sigma, sigma_next, config)
    mean, std, std_dev_t = transition_mean_std(x, v, sigma, sigma_next, sigma_max=sigma_max, config=config)
    if config.kind == "ode":
        zeros = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        return StepResult(sample=mean, mean=mean, std=zeros, std_dev_t=zeros, log_prob=zeros.clone())
    eps = _draw_noise(x, noise, generator)
    residual = eps * std
    sample = mean + residual
    log_prob = _log_prob_of_residual(residual, std, config.no_const)
    return StepResult(sample=sample, mean=mean, std=_per_sample(std, x), std_dev_t=_per_sample(std_dev_t, x),
                      log_prob=log_prob)


def transition_log_prob(x: torch.Tensor, v: torch.Tensor, x_next: torch.Tensor, sigma, sigma_next, *,
                        sigma_max, config: TransitionConfig) -> StepResult:
    """log p(x_next | x, v) of one step, differentiable in ``v``; ODE steps return 0."""
    _check_step(sigma, sigma_next, config)
    x = x.detach()
    mean, std, std_dev_t = transition_mean_std(x, v, sigma, sigma_next, sigma_max=sigma_max, config=config)
    if config.kind == "ode":
        log_prob = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    else:
        log_prob = gaussian_log_prob(x_next.detach(), mean, std, no_const=config.no_const)
    return StepResult(sample=mean if config.kind == "ode" else x_next.detach().float(), mean=mean,
                      std=_per_sample(std, x), std_dev_t=_per_sample(std_dev_t, x), log_prob=log_prob)


def sde_step_mask(num_steps: int, sde_step_indices: Sequence[int] | None = None) -> torch.Tensor:
    """Bool ``[num_steps]``: True where a step is stochastic (``None`` = every step); ValueError for indices
    outside ``[0, num_steps)``."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps!r}")
    mask = torch.zeros(num_steps, dtype=torch.bool)
    if sde_step_indices is None:
        return mask.fill_(True)
    for i in sde_step_indices:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_steps:
            raise ValueError(f"sde step index {i!r} outside [0, {num_steps})")
        mask[i] = True
    return mask


def config_for_step(config: TransitionConfig, step_index: int,
                    sde_step_indices: Sequence[int] | None) -> TransitionConfig:
    """The effective config of step ``step_index``: ODE when the window excludes it, else ``config``."""
    if config.kind == "ode" or sde_step_indices is None or step_index in sde_step_indices:
        return config
    return TransitionConfig(kind="ode", noise_level=config.noise_level, no_const=config.no_const)
