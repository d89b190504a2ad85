"""DGPO loss (Direct Group Preference Optimization, arXiv 2510.08425): a group-level DPO on clean ODE samples,
(1/β)·softplus(s_g) per group. Pure torch. Invariant: its gradient is σ(s_g)·A_i·∇ℓ_i per item whatever the
split of a group over calls (pass ``scores``). Details: docs/algorithms/dgpo.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from megaflow.algo.masked import keep_mask, reduce, select
from megaflow.flow.forward import matching_error, noised

__all__ = ["DGPOConfig", "DGPO_RECIPES", "GroupScores", "dgpo_group_scores", "dgpo_loss", "ema_ref_decay",
           "matching_error", "noised"]

# The authors' recipes (Luo-Yihong/DGPO, SD3.5-M GenEval configs geneval_sd3_4gpu; README "Hyper-parameter
# Recipes"). "reference" is the policy whose velocity enters the preference as v_ref: the frozen base model
# or the fast EMA; the KL (kl_beta) is always to the frozen base. Rollouts: deterministic ODE (noise_level 0).
DGPO_RECIPES = {
    # config/dgpo.py: rollout with CFG 4.5, training without CFG (the authors' default mode)
    "cfg_rollout": {"dgpo_beta": 100.0, "kl_beta": 0.02, "dgpo_clip_range": 1e-2, "guidance_scale": 4.5,
                    "reference": "frozen"},
    # config/dgpo_wocfg.py: CFG-free rollout and training, frozen reference evaluated with CFG 4.5 (kl_cfg)
    "cfg_free_frozen_ref": {"dgpo_beta": 100.0, "kl_beta": 0.02, "dgpo_clip_range": 1e-3, "guidance_scale": 1.0,
                            "reference": "frozen"},
    # config/dgpo_wocfg_emaref.py: CFG-free, the fast EMA as the preference reference (TDM-R1 style)
    "cfg_free_ema_ref": {"dgpo_beta": 2000.0, "kl_beta": 1e-3, "dgpo_clip_range": 1e-5, "guidance_scale": 1.0,
                         "reference": "ema"},
}
DGPO_ROLLOUT_STEPS = 10          # sample.num_steps (eval_num_steps 14 with CFG, 10 CFG-free)
DGPO_GROUP_SIZE = 16             # sample.num_image_per_prompt ("set to be 24 for better performance")
DGPO_GROUPS_PER_BATCH = 8        # num_groups per rollout batch ("set to be 24"); one optimizer step per batch
DGPO_TRUNC_STEPS = 4             # trunc_steps: grid indices 0..4 of 10 are trained (shifted sigma >= 0.79)
DGPO_NUM_TIMESTEPS = 4           # num_train_timesteps: drawn without replacement from those, shared by the batch
DGPO_LEARNING_RATE = 3e-4        # config/base.py train.learning_rate (AdamW, LoRA r=64 alpha=128)
DGPO_EMA_DECAY_MAX = 0.3         # ema_ref: d = min(0.3, 0.001 * optimizer steps), stepped every optimizer step
DGPO_EMA_DECAY_RATE = 1e-3
DGPO_SWITCH_EMA_REF = 500        # GenEval: after this many optimizer steps the engines sample with the fast EMA


@dataclass(frozen=True, kw_only=True)
class DGPOConfig:
    """DGPO loss knobs (defaults: the authors' CFG-free EMA-reference GenEval recipe, ``DGPO_RECIPES``);
    field names are the ``[algo]`` config keys."""

    dgpo_beta: float = 2000.0
    """β of the group preference: s_g = (β/G)·Σ A_i·(ℓ_i − ℓ_ref,i); larger = sharper sigmoid weights."""
    dgpo_clip_range: float = 1e-5
    """ε of the PPO-style clip: an item stops pulling once exp(ℓ_old − ℓ_θ) leaves 1 ± ε in its advantage's
    direction (needs old_velocity); 0 = no clip."""
    kl_beta: float = 1e-3
    """Weight of mean((v_θ − v_kl)²), the velocity KL to the frozen reference; 0 = off."""
    adv_clip: float = 5.0
    """Advantages are clipped to [−adv_clip, adv_clip] (authors' adv_clip_max)."""

    def __post_init__(self) -> None:
        if not (self.dgpo_beta > 0 and math.isfinite(self.dgpo_beta)):
            raise ValueError(f"dgpo_beta must be a positive finite number, got {self.dgpo_beta!r}")
        if not (self.adv_clip > 0 and math.isfinite(self.adv_clip)):
            raise ValueError(f"adv_clip must be a positive finite number, got {self.adv_clip!r}")
        for name in ("dgpo_clip_range", "kl_beta"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def ema_ref_decay(optimizer_steps: int, rate: float = DGPO_EMA_DECAY_RATE, cap: float = DGPO_EMA_DECAY_MAX) -> float:
    """Decay d of the fast EMA reference, θ_e ← d·θ_e + (1 − d)·θ: min(cap, rate · optimizer steps so far)."""
    return min(cap, rate * optimizer_steps)


def _check_group_size(group_size: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")


class GroupScores(NamedTuple):
    """Per item [B], float64, no grad: ``score`` s_{g(i)} and ``count`` n_g, the kept members of i's group."""

    score: torch.Tensor
    count: torch.Tensor

    def take(self, index: torch.Tensor) -> GroupScores:
        """The scores of the items ``index`` (a microbatch of the batch they were computed over)."""
        return GroupScores(self.score[index], self.count[index])


def dgpo_group_scores(error: torch.Tensor, ref_error: torch.Tensor, advantages: torch.Tensor,
                      group_ids: torch.Tensor, *, config: DGPOConfig, group_size: int,
                      mask: torch.Tensor | None = None) -> GroupScores:
    """s_{g(i)} = (β/G)·Σ over the kept items j of i's group of clip(A_j)·(ℓ_j − ℓ_ref,j), and n_g, for every
    item. ``error`` / ``ref_error`` are ``matching_error`` of θ and of the reference; ``group_ids`` [B] ints
    name the preference groups (one prompt's samples at one timestep)."""
    _check_group_size(group_size)
    keep = keep_mask(mask, error)
    adv = select(keep, advantages).clamp(-config.adv_clip, config.adv_clip)
    delta = select(keep, error.detach()) - select(keep, ref_error.detach())
    _, inverse = torch.unique(group_ids, return_inverse=True)
    sums = torch.zeros(int(inverse.max()) + 1 if inverse.numel() else 0, dtype=torch.float64, device=error.device)
    counts = torch.zeros_like(sums)
    sums.index_add_(0, inverse, adv * delta)
    counts.index_add_(0, inverse, keep.double())
    return GroupScores(sums[inverse] * (config.dgpo_beta / group_size), counts[inverse])


def dgpo_loss(velocity: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, advantages: torch.Tensor,
              group_ids: torch.Tensor, *, config: DGPOConfig, group_size: int, ref_velocity: torch.Tensor,
              old_velocity: torch.Tensor | None = None, kl_velocity: torch.Tensor | None = None,
              scores: GroupScores | None = None, mask: torch.Tensor | None = None,
              normalizer: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DGPO loss of a batch of items. ``velocity`` carries grads; ``ref_velocity``, ``old_velocity`` (iff
    dgpo_clip_range > 0), ``kl_velocity`` (iff kl_beta > 0) are constants. Without ``scores`` every group must be
    whole in this call; with them (``dgpo_group_scores``) a group may span calls. Returns (loss, detached stats)."""
    if config.dgpo_clip_range > 0 and old_velocity is None:
        raise ValueError(f"dgpo_clip_range = {config.dgpo_clip_range} > 0 needs old_velocity")
    if config.kl_beta > 0 and kl_velocity is None:
        raise ValueError(f"kl_beta = {config.kl_beta} > 0 needs kl_velocity")
    keep = keep_mask(mask, velocity)
    x0s, eps = select(keep, x0), select(keep, noise)
    v = select(keep, velocity)
    error = matching_error(v, x0s, eps)
    ref_error = matching_error(select(keep, ref_velocity.detach()), x0s, eps)
    if scores is None:
        scores = dgpo_group_scores(error, ref_error, advantages, group_ids, config=config, group_size=group_size,
                                   mask=keep)
    zero = torch.zeros((), dtype=torch.float64, device=v.device)
    s = torch.where(keep, scores.score.detach().double(), zero)
    share = group_size / torch.where(keep, scores.count.double(), zero).clamp(min=1)
    adv = select(keep, advantages).clamp(-config.adv_clip, config.adv_clip)
    pull = torch.ones_like(keep)
    if config.dgpo_clip_range > 0:
        ratio = torch.exp(matching_error(select(keep, old_velocity.detach()), x0s, eps) - error.detach())
        eps_clip = config.dgpo_clip_range
        pull = ~torch.where(adv > 0, ratio > 1 + eps_clip, ratio < 1 - eps_clip)
    gradient_part = torch.where(pull, torch.sigmoid(s) * adv * (error - error.detach()), torch.zeros_like(error))
    preference = share * F.softplus(s) / config.dgpo_beta + gradient_part
    kl = torch.zeros_like(error)
    if kl_velocity is not None:
        kl = (v - select(keep, kl_velocity.detach())).pow(2).mean(dim=tuple(range(1, v.dim())))
    per_item = preference + config.kl_beta * kl
    out = torch.float64 if velocity.dtype == torch.float64 else torch.float32
    loss = reduce(per_item, keep, normalizer).to(out)
    with torch.no_grad():
        mean = lambda x: reduce(x.detach().double(), keep, None).float()  # noqa: E731
        stats = {"policy_loss": mean(preference), "kl": mean(kl), "matching_loss": mean(error),
                 "ref_deviation": mean(error - ref_error), "group_weight": mean(torch.sigmoid(s)),
                 "clip_frac": mean((~pull).double())}
    return loss, stats
