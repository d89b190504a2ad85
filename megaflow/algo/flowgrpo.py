"""FlowGRPO loss: PPO-clip over per-step log-probs, the Gaussian KL to a reference, TIS / MIS mismatch
correction, and the trained steps. Pure torch. Invariant: masked-out entries never reach the arithmetic, so NaN
/ inf there cannot reach loss or gradient. Formulas and sources: docs/algorithms/flowgrpo.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from megaflow.flow.step import StepResult, TransitionConfig, sde_step_mask

__all__ = [
    "LossConfig",
    "MismatchConfig",
    "MismatchWeights",
    "ppo_clip_loss",
    "gaussian_kl",
    "flow_grpo_loss",
    "mismatch_weights",
    "train_step_indices",
]

_KL_STDS = ("flow_grpo", "transition")
_MISMATCH_MODES = ("tis", "mis")
_MISMATCH_LEVELS = ("step", "trajectory", "geometric")


@dataclass(frozen=True, kw_only=True)
class LossConfig:
    """FlowGRPO loss knobs (defaults: flow_grpo SD3 recipe); field names are the ``[algo]`` config keys."""

    clip_range: float = 1e-4
    """ε of the PPO ratio clip (flow_grpo 1e-4; 1e-5 with CPS or an SDE window, see ``auto_clip_range``)."""
    kl_beta: float = 0.04
    """β of the KL to the reference policy; 0 disables it (CFG-free fast recipes)."""
    kl_std: str = "flow_grpo"
    """Std in the KL denominator: "flow_grpo" (std_dev_t = s, no sqrt(−dt)) or "transition" (true KL)."""

    def __post_init__(self) -> None:
        if not (0 < self.clip_range < 1):
            raise ValueError(f"clip_range must be in (0, 1), got {self.clip_range!r}")
        if not (self.kl_beta >= 0 and math.isfinite(self.kl_beta)):
            raise ValueError(f"kl_beta must be a finite number >= 0, got {self.kl_beta!r}")
        if self.kl_std not in _KL_STDS:
            raise ValueError(f"kl_std must be one of {_KL_STDS}, got {self.kl_std!r}")

    @staticmethod
    def auto_clip_range(kind: str, *, windowed: bool) -> float:
        """flow_grpo's ε for a rollout kind: 1e-5 for CPS or a FlowGRPO-Fast window, else 1e-4."""
        return 1e-5 if kind == "cps" or windowed else 1e-4


@dataclass(frozen=True, kw_only=True)
class MismatchConfig:
    """Importance correction between the trainer's and the engine's log-probs of the same samples; field
    names are the ``[algo]`` config keys (``algo.mismatch = "none"`` builds no MismatchConfig)."""

    mismatch: str = "tis"
    """"tis": truncate w to [floor, cap]; "mis": reject (w = 0, excluded) outside [floor, cap]."""
    mismatch_level: str = "step"
    """"step": per-step ratio; "trajectory": product over a sample's trained steps; "geometric": their
    geometric mean (exp of the mean log-ratio)."""
    mismatch_cap: float = 2.0
    """C, the upper bound."""
    mismatch_floor: float = 0.0
    """Lower bound (0 = none)."""

    def __post_init__(self) -> None:
        if self.mismatch not in _MISMATCH_MODES:
            raise ValueError(f"mismatch must be one of {_MISMATCH_MODES}, got {self.mismatch!r}")
        if self.mismatch_level not in _MISMATCH_LEVELS:
            raise ValueError(f"mismatch_level must be one of {_MISMATCH_LEVELS}, got {self.mismatch_level!r}")
        if not (0 <= self.mismatch_floor < self.mismatch_cap):
            raise ValueError(f"need 0 <= mismatch_floor < mismatch_cap, got {self.mismatch_floor!r} and "
                             f"{self.mismatch_cap!r}")


@dataclass(frozen=True)
class MismatchWeights:
    """``weights`` (0 where not kept) and ``keep`` (bool) have the log-prob shape; ``stats`` to log."""

    weights: torch.Tensor
    keep: torch.Tensor
    stats: dict[str, torch.Tensor]


def _mask_like(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if mask is None:
        return torch.ones_like(like, dtype=torch.bool)
    if mask.shape != like.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != log-prob shape {tuple(like.shape)}")
    return mask.to(device=like.device, dtype=torch.bool)


def _masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over ``mask``; masked-out entries are dropped by ``torch.where`` (NaN/inf there stay out)."""
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum()


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _masked_sum(values, mask) / mask.sum().clamp(min=1).to(values.dtype)


def _reduce(values: torch.Tensor, mask: torch.Tensor, normalizer) -> torch.Tensor:
    """Masked mean (``normalizer`` None) or masked sum / normalizer."""
    if normalizer is None:
        return _masked_mean(values, mask)
    if not float(normalizer) > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer!r}")
    return _masked_sum(values, mask) / normalizer


def _broadcast_adv(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    adv = advantages.detach().to(device=like.device, dtype=torch.float32)
    if adv.shape == like.shape:
        return adv
    if adv.dim() == 1 and adv.shape[0] == like.shape[0]:
        return adv.view(-1, *([1] * (like.dim() - 1)))
    raise ValueError(f"advantages shape {tuple(adv.shape)} fits neither [B] nor log-prob {tuple(like.shape)}")


def ppo_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, *,
                  clip_range: float, mask: torch.Tensor | None = None, weights: torch.Tensor | None = None,
                  normalizer: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``w·max(−A·ρ, −A·clip(ρ, 1−ε, 1+ε))`` reduced over ``mask`` (mean, or sum / ``normalizer``);
    ``weights`` (TIS/MIS) default 1. Stats are means over the masked-in entries of this call."""
    if log_prob.shape != old_log_prob.shape:
        raise ValueError(f"log_prob {tuple(log_prob.shape)} and old_log_prob {tuple(old_log_prob.shape)} differ")
    mask = _mask_like(mask, log_prob)
    zero = torch.zeros((), dtype=torch.float32, device=log_prob.device)
    adv = torch.where(mask, _broadcast_adv(advantages, log_prob), zero)
    old = old_log_prob.detach().to(device=log_prob.device)
    delta = torch.where(mask, log_prob - torch.where(mask, old, log_prob.detach()), zero)
    ratio = torch.exp(delta)
    per = torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range))
    if weights is not None:
        per = per * torch.where(mask, weights.detach().to(device=per.device, dtype=per.dtype), zero)
    loss = _reduce(per, mask, normalizer)
    with torch.no_grad():
        r = ratio.detach()
        any_kept = bool(mask.any())
        stats = {
            "policy_loss": loss.detach() if normalizer is None else _masked_mean(per.detach(), mask),
            "clip_frac": _masked_mean(((r - 1).abs() > clip_range).float(), mask),
            "approx_kl": _masked_mean(0.5 * delta.detach() ** 2, mask),
            "ratio_mean": _masked_mean(r, mask),
            "ratio_max": r[mask].max() if any_kept else torch.ones((), device=r.device),
            "ratio_min": r[mask].min() if any_kept else torch.ones((), device=r.device),
        }
    return loss, stats


def gaussian_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-step KL ``mean_elements((μ − μ_ref)²) / (2·std²)``, shape of ``std`` (``[B]`` or ``[B, T]``).

    ``mean`` is ``std.shape + latent shape``; ``ref_mean`` is detached (frozen reference).
    """
    lead = std.dim()
    if lead == 0 or mean.shape[:lead] != std.shape or mean.shape != ref_mean.shape:
        raise ValueError(f"mean {tuple(mean.shape)}, ref_mean {tuple(ref_mean.shape)} and std "
                         f"{tuple(std.shape)}: need mean == ref_mean shape with std as leading dims")
    sq = (mean.float() - ref_mean.detach().float()) ** 2
    return sq.mean(dim=tuple(range(lead, sq.dim()))) / (2 * std.float() ** 2)


def flow_grpo_loss(policy: StepResult, *, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                   config: LossConfig, ref_mean: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                   is_weights: torch.Tensor | None = None,
                   normalizer: float | torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``L_pg + β·KL`` of a recomputed step (or stacked steps); ``ref_mean`` needed iff β > 0 (KL on a kept std-0
    step raises ValueError). Reduced as mean over ``mask`` or sum / ``normalizer``; stats are means over ``mask``."""
    loss, stats = ppo_clip_loss(policy.log_prob, old_log_prob, advantages, clip_range=config.clip_range,
                                mask=mask, weights=is_weights, normalizer=normalizer)
    if config.kl_beta > 0:
        if ref_mean is None:
            raise ValueError(f"kl_beta={config.kl_beta} > 0 needs ref_mean (the reference policy's step mean)")
        keep = _mask_like(mask, policy.log_prob)
        std = policy.std_dev_t if config.kl_std == "flow_grpo" else policy.std
        if bool(((std == 0) & keep).any()):
            raise ValueError("KL on a step with std 0 (CPS sigma_next=0 or ODE): mask those steps out")
        lead = keep.view(*keep.shape, *([1] * (policy.mean.dim() - keep.dim())))
        ref = torch.where(lead, ref_mean.detach().to(policy.mean.device), policy.mean.detach())
        per_step = gaussian_kl(policy.mean, ref, torch.where(keep, std, torch.ones_like(std)))
        kl_term = _reduce(per_step, keep, normalizer)
        loss = loss + config.kl_beta * kl_term
        stats["kl"] = _masked_mean(per_step.detach(), keep)
    stats["loss"] = stats["policy_loss"] + config.kl_beta * stats["kl"] if config.kl_beta > 0 else stats["policy_loss"]
    return loss, stats


def _aggregate_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Per-entry log-ratio (step), or each sample's sum (trajectory) / mean (geometric) over its masked-in
    steps, broadcast back over the steps."""
    if level == "step":
        return log_ratio
    m = mask.to(log_ratio.dtype)
    total = (log_ratio * m).sum(dim=tuple(range(1, log_ratio.dim())), keepdim=True)
    if level == "geometric":
        total = total / m.sum(dim=tuple(range(1, m.dim())), keepdim=True).clamp(min=1)
    return total.expand_as(log_ratio)


def mismatch_weights(train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, config: MismatchConfig,
                     mask: torch.Tensor | None = None) -> MismatchWeights:
    """TIS/MIS weights from old and engine log-probs, ``[B]`` (step level only) or ``[B, T]``; masked-out steps get
    weight 0, keep False and stay out of trajectory/geometric aggregates."""
    if train_log_prob.shape != rollout_log_prob.shape:
        raise ValueError(f"train {tuple(train_log_prob.shape)} and rollout {tuple(rollout_log_prob.shape)} "
                         "log-prob shapes differ")
    if config.mismatch_level != "step" and train_log_prob.dim() < 2:
        raise ValueError(f"mismatch_level={config.mismatch_level!r} needs [B, T] log-probs (every trained step of "
                         f"each sample), got shape {tuple(train_log_prob.shape)}")
    mask = _mask_like(mask, train_log_prob)
    log_ratio = (train_log_prob.detach().float() - rollout_log_prob.detach().float().to(train_log_prob.device))
    log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    raw = torch.exp(_aggregate_log_ratio(log_ratio, mask, config.mismatch_level))
    high = mask & (raw > config.mismatch_cap)
    low = mask & (raw < config.mismatch_floor)
    if config.mismatch == "tis":
        keep = mask
        weights = raw.clamp(min=config.mismatch_floor, max=config.mismatch_cap)
    else:
        keep = mask & ~high & ~low
        weights = raw
    weights = torch.where(keep, weights, torch.zeros_like(weights))
    stats = {
        "is_weight_mean": _masked_mean(weights, keep),
        "is_raw_weight_mean": _masked_mean(raw, mask),
        "is_log_ratio_abs_mean": _masked_mean(log_ratio.abs(), mask),
        "is_frac_high": _masked_mean(high.float(), mask),
        "is_frac_low": _masked_mean(low.float(), mask),
        "is_frac_rejected": _masked_mean((mask & ~keep).float(), mask),
    }
    return MismatchWeights(weights=weights, keep=keep, stats=stats)


def train_step_indices(num_steps: int, transition: TransitionConfig,
                       sde_step_indices: Sequence[int] | None = None, *,
                       timestep_fraction: float = 1.0) -> list[int]:
    """The denoising steps to train: the stochastic ones (CPS's std-0 last step left out); ValueError for an
    all-ODE rollout. Without a window only ``t < int(num_steps · timestep_fraction)``; with one, every window step."""
    if transition.kind == "ode":
        raise ValueError("an ode rollout has no stochastic step to train on; use kind 'sde' or 'cps'")
    if not 0 < timestep_fraction <= 1:
        raise ValueError(f"timestep_fraction must be in (0, 1], got {timestep_fraction!r}")
    mask = sde_step_mask(num_steps, sde_step_indices)
    if transition.kind == "cps":
        mask[num_steps - 1] = False
    if sde_step_indices is None:
        mask[int(num_steps * timestep_fraction):] = False
    steps = mask.nonzero().flatten().tolist()
    if not steps:
        raise ValueError(f"no trainable step among sde_step_indices={sde_step_indices!r} for {transition.kind} "
                         f"(num_steps={num_steps}, timestep_fraction={timestep_fraction})")
    return steps
