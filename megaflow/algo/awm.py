"""AWM loss (Advantage Weighted Matching, arXiv 2509.25050): advantage-weighted flow matching on clean ODE
samples, a PPO-clipped ratio and velocity KLs to the reference and a fast EMA. Pure torch.
Invariant: at θ = θ_old the gradient is that of advantage-weighted flow matching. Details: docs/algorithms/awm.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megaflow.algo.masked import keep_mask, reduce, select
from megaflow.flow.forward import matching_error, noised

__all__ = ["AWMConfig", "WEIGHTINGS", "awm_loss", "awm_timestep_indices", "kl_ema_decay", "matching_error",
           "noised", "weighted_matching"]

WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")
_EPS = 1e-10  # the authors' floor inside huber / ghuber (compute_log_prob_awm)

# The authors' recipe: scxue/advantage_weighted_matching, config/dgx_awm.py geneval_sd3_no_cfg_1node (SD3.5-M)
# and the README's parameter table, unless a line says otherwise.
AWM_ROLLOUT_STEPS = 14            # sample.num_steps (guidance_scale 1.0: no CFG in rollout or training)
AWM_EVAL_STEPS = 40               # sample.eval_num_steps
AWM_GROUP_SIZE = 24               # sample.num_image_per_prompt
AWM_NUM_TIMESTEPS = 6             # train.train_timesteps
AWM_TIMESTEP_FRACTION = 0.9       # train.timestep_fraction, with time_type "discrete_wo_init"
AWM_LEARNING_RATE = 3e-4          # train.learning_rate (AdamW, LoRA r=32 alpha=64 on attention)
AWM_KL_BETA_OCR = 3e-3            # train.beta, OCR config and README; GenEval's was 3e-3 too until be51372
AWM_KL_BETA_GENEVAL = 1e-3        # train.beta, GenEval config since commit be51372 (2026-03)
AWM_KL_BETA_PICKSCORE = 1e-4      # train.beta, PickScore config
AWM_EMA_KL_BETA = 1.0             # train.ema_beta ("KL-EMA, mimic TRPO")
AWM_EMA_DECAY_MAX = 0.3           # train.kl_ema_decay
AWM_EMA_DECAY_RATE = 1e-3         # kl_ema_decay_type "linear": d = min(0.3, 0.001 * optimizer steps)
AWM_EVAL_EMA_DECAY = 0.99         # train.ema_decay: the evaluation EMA, not the KL one


@dataclass(frozen=True, kw_only=True)
class AWMConfig:
    """AWM loss knobs (defaults: the authors' SD3.5-M recipe as their README gives it, kl_beta 0.003 as for OCR;
    their GenEval config now uses 0.001); field names are the ``[algo]`` config keys."""

    adv_clip: float = 5.0
    """c: advantages are clipped to [−c, c] (authors' adv_clip_max)."""
    awm_advantage_max: float = 1.0
    """The clipped advantage is rescaled to A' = clip(A, −c, c) / c · awm_advantage_max (authors' advantage_max)."""
    awm_weighting: str = "ghuber"
    """W(ℓ, t): "uniform" ℓ, "t" t·ℓ, "t2" t²·ℓ, "huber" t·(sqrt(ℓ + δ) − sqrt δ), "ghuber" t·((ℓ + δ)^p − δ^p)/p."""
    awm_ghuber_power: float = 0.25
    """p of the "ghuber" weighting (p = 1 is the "t" weighting)."""
    awm_clip_range: float = 1.0
    """ε of the PPO clip of exp(logp_θ − logp_old) (authors: 1, inactive on-policy where the ratio is 1)."""
    kl_beta: float = AWM_KL_BETA_OCR
    """Weight of mean((v_θ − v_ref)²), the velocity KL to the frozen reference; 0 = no reference."""
    awm_ema_kl_beta: float = AWM_EMA_KL_BETA
    """Weight of mean((v_θ − v_ema)²), the velocity KL to the fast EMA; 0 = no EMA."""

    def __post_init__(self) -> None:
        for name in ("adv_clip", "awm_advantage_max", "awm_ghuber_power", "awm_clip_range"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        for name in ("kl_beta", "awm_ema_kl_beta"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.awm_weighting not in WEIGHTINGS:
            raise ValueError(f"awm_weighting must be one of {WEIGHTINGS}, got {self.awm_weighting!r}")


def weighted_matching(error: torch.Tensor, t: torch.Tensor, weighting: str, power: float = 0.25) -> torch.Tensor:
    """W(ℓ, t) ≥ 0, the negative of the authors' weighted log-probability (module doc; W(0, t) = 0)."""
    t = t.to(error.dtype)
    if weighting == "uniform":
        return error
    if weighting == "t":
        return t * error
    if weighting == "t2":
        return t * t * error
    if weighting == "huber":
        return t * (torch.sqrt(error + _EPS) - math.sqrt(_EPS))
    if weighting == "ghuber":
        return t * ((error + _EPS).pow(power) - _EPS ** power) / power
    raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")


def kl_ema_decay(optimizer_steps: int, rate: float = AWM_EMA_DECAY_RATE, cap: float = AWM_EMA_DECAY_MAX) -> float:
    """Decay d of the KL's fast EMA, θ_ema ← d·θ_ema + (1 − d)·θ: min(cap, rate · optimizer steps so far)."""
    return min(cap, rate * optimizer_steps)


def awm_timestep_indices(num_steps: int, num_timesteps: int = AWM_NUM_TIMESTEPS,
                         fraction: float = AWM_TIMESTEP_FRACTION, *,
                         generator: torch.Generator | None = None) -> list[int]:
    """The grid indices to train (authors' "discrete_wo_init"): [1, int(num_steps·fraction)] cut into
    ``num_timesteps`` strata at floor(linspace) points, one uniform draw in each; index 0 (pure noise) never.
    14 steps, 6 timesteps, 0.9: strata {1}, {2,3}, {4,5}, {6,7}, {8,9}, {10,11}."""
    top = int(num_steps * fraction)
    if not (1 <= num_timesteps <= top - 1):
        raise ValueError(f"num_timesteps = {num_timesteps} needs 1 <= it <= int(num_steps * fraction) - 1 = {top - 1}")
    bounds = torch.linspace(1, top, num_timesteps + 1, dtype=torch.float64).long()
    lower, upper = bounds[:-1], bounds[1:]
    if bool((upper <= lower).any()):
        raise ValueError(f"num_timesteps = {num_timesteps} leaves an empty stratum in [1, {top}]")
    u = torch.rand(num_timesteps, generator=generator, dtype=torch.float64)
    return (lower + (u * (upper - lower)).long()).tolist()


def awm_loss(velocity: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor,
             advantages: torch.Tensor, *, config: AWMConfig, old_velocity: torch.Tensor | None = None,
             ref_velocity: torch.Tensor | None = None, ema_velocity: torch.Tensor | None = None,
             mask: torch.Tensor | None = None,
             normalizer: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The AWM loss of a batch of items (x0, t, ε each). ``velocity`` [B, ...] carries grads; ``old_velocity``
    (None = on-policy, ratio 1), ``ref_velocity`` (iff kl_beta > 0), ``ema_velocity`` (iff awm_ema_kl_beta > 0) are
    constants; ``t``, ``advantages``, ``mask`` [B]. Returns (loss, detached stats), float64 for float64 input else float32."""
    if config.kl_beta > 0 and ref_velocity is None:
        raise ValueError(f"kl_beta = {config.kl_beta} > 0 needs ref_velocity")
    if config.awm_ema_kl_beta > 0 and ema_velocity is None:
        raise ValueError(f"awm_ema_kl_beta = {config.awm_ema_kl_beta} > 0 needs ema_velocity")
    keep = keep_mask(mask, velocity)
    v, target_x0, eps = select(keep, velocity), select(keep, x0), select(keep, noise)
    tt = select(keep, t)
    c, eps_clip = config.adv_clip, config.awm_clip_range
    adv = select(keep, advantages).clamp(-c, c) / c * config.awm_advantage_max
    error = matching_error(v, target_x0, eps)
    weighted = weighted_matching(error, tt, config.awm_weighting, config.awm_ghuber_power)
    log_prob = -weighted
    if old_velocity is None:
        old_log_prob = log_prob.detach()
    else:
        old_err = matching_error(select(keep, old_velocity.detach()), target_x0, eps)
        old_log_prob = -weighted_matching(old_err, tt, config.awm_weighting, config.awm_ghuber_power)
    ratio = torch.exp(log_prob - old_log_prob)
    policy = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_clip, 1 + eps_clip))
    dims = tuple(range(1, v.dim()))
    zero = torch.zeros_like(policy)
    kl = (v - select(keep, ref_velocity.detach())).pow(2).mean(dim=dims) if ref_velocity is not None else zero
    ema_kl = (v - select(keep, ema_velocity.detach())).pow(2).mean(dim=dims) if ema_velocity is not None else zero
    per_item = policy + config.kl_beta * kl + config.awm_ema_kl_beta * ema_kl
    out = torch.float64 if velocity.dtype == torch.float64 else torch.float32
    loss = reduce(per_item, keep, normalizer).to(out)
    with torch.no_grad():
        mean = lambda x: reduce(x.detach(), keep, None).float()  # noqa: E731
        stats = {"policy_loss": mean(policy), "kl": mean(kl), "ema_kl": mean(ema_kl),
                 "matching_loss": mean(error), "weighted_matching": mean(weighted),
                 "ratio_mean": mean(ratio), "clip_frac": mean(((ratio - 1).abs() > eps_clip).double()),
                 "advantage_abs": mean(adv.abs())}
    return loss, stats
