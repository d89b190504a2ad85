"""Group-normalised FlowGRPO advantages with a zero-std group filter and masked (NaN) rewards:
A_i = clip((r_i − mean_{g(i)} r) / (std + 1e-4), −c, c) (flow_grpo's ``PerPromptStatTracker``, type 'grpo').
Design notes: docs/design/algo.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["AdvantageConfig", "Advantages", "contiguous_group_ids", "group_advantages"]

_STD_MODES = ("batch", "group")


@dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    """How rewards become advantages; field names are the ``[algo]`` config keys (built by name from it)."""

    adv_clip: float = 5.0
    """c: advantages are clipped to [−c, c] (flow_grpo ``adv_clip_max``)."""
    std_mode: str = "batch"
    """"batch": divide by the std of all valid rewards (flow_grpo default); "group": by the group's std."""
    eps: float = 1e-4
    """Added to the std before dividing (flow_grpo: 1e-4)."""
    filter_zero_std: bool = True
    """Drop (keep=False) samples of groups whose valid rewards are all equal."""

    def __post_init__(self) -> None:
        if self.std_mode not in _STD_MODES:
            raise ValueError(f"std_mode must be one of {_STD_MODES}, got {self.std_mode!r}")
        if not (self.adv_clip > 0 and math.isfinite(self.adv_clip)):
            raise ValueError(f"adv_clip must be a positive finite number, got {self.adv_clip!r}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps!r}")


@dataclass(frozen=True)
class Advantages:
    """Result of ``group_advantages`` (tensors ``[N]``): ``advantages`` 0 where ``keep`` is False; ``keep`` = valid
    reward and (if filtering) non-zero group std; ``stats`` floats to log."""

    advantages: torch.Tensor
    keep: torch.Tensor
    valid: torch.Tensor
    zero_std_group: torch.Tensor
    dropped_ratio: float
    stats: dict[str, float]


def contiguous_group_ids(num_samples: int, group_size: int) -> torch.Tensor:
    """Group ids ``[0]*k + [1]*k + ...`` for a batch laid out as consecutive groups of ``group_size``."""
    if group_size < 1 or num_samples % group_size:
        raise ValueError(f"num_samples={num_samples} is not a positive multiple of group_size={group_size}")
    return torch.arange(num_samples) // group_size


def _group_index(group_ids: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    if group_ids.shape != (n,):
        raise ValueError(f"group_ids must have shape [{n}], got {tuple(group_ids.shape)}")
    if group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(inverse.max()) + 1


def _group_sum(values: torch.Tensor, index: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor,
                     config: AdvantageConfig = AdvantageConfig()) -> Advantages:
    """FlowGRPO advantages of ``rewards [N]`` grouped by ``group_ids [N]`` (e.g. prompt index)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    n = rewards.shape[0]
    if n == 0:
        raise ValueError("rewards is empty")
    index, num_groups = _group_index(group_ids.to(rewards.device), n)
    r = rewards.detach().to(torch.float64)
    valid = torch.isfinite(r)
    r0 = torch.where(valid, r, torch.zeros_like(r))
    w = valid.to(torch.float64)

    count = _group_sum(w, index, num_groups)
    mean = _group_sum(r0, index, num_groups) / count.clamp(min=1)
    dev = torch.where(valid, r0 - mean[index], torch.zeros_like(r0))
    group_var = _group_sum(dev**2, index, num_groups) / count.clamp(min=1)
    # Zero std = all valid rewards equal (exact test on max == min, immune to rounding in the mean).
    inf = torch.full((num_groups,), math.inf, dtype=torch.float64, device=r.device)
    gmax = (-inf).scatter_reduce(0, index, torch.where(valid, r0, -math.inf), "amax")
    gmin = inf.scatter_reduce(0, index, torch.where(valid, r0, math.inf), "amin")
    zero_std = (gmax <= gmin) & (count > 0)

    if config.std_mode == "batch":
        num_valid = w.sum()
        batch_mean = r0.sum() / num_valid.clamp(min=1)
        batch_var = (torch.where(valid, r0 - batch_mean, torch.zeros_like(r0)) ** 2).sum() / num_valid.clamp(min=1)
        std = batch_var.sqrt().expand(n)
    else:
        std = group_var.sqrt()[index]
    adv = (dev / (std + config.eps)).clamp(-config.adv_clip, config.adv_clip)

    keep = valid & ~zero_std[index] if config.filter_zero_std else valid
    adv = torch.where(keep, adv, torch.zeros_like(adv)).to(torch.float32)
    num_valid = int(valid.sum())
    num_dropped = int((valid & ~keep).sum())
    dropped_ratio = num_dropped / num_valid if num_valid else 0.0
    finite = r[valid]
    stats = {
        "reward_mean": float(finite.mean()) if num_valid else math.nan,
        "reward_std": float(finite.std(correction=0)) if num_valid else math.nan,
        "masked_ratio": 1.0 - num_valid / n if n else 0.0,
        "zero_std_groups": float(zero_std.sum()),
        "zero_std_dropped_ratio": dropped_ratio,
        "adv_abs_mean": float(adv[keep].abs().mean()) if bool(keep.any()) else 0.0,
        "adv_clip_frac": float((dev.abs() / (std + config.eps) > config.adv_clip)[keep].float().mean())
        if bool(keep.any()) else 0.0,
    }
    return Advantages(advantages=adv, keep=keep, valid=valid, zero_std_group=zero_std[index],
                      dropped_ratio=dropped_ratio, stats=stats)
