"""DiffusionNFT loss: negative-aware fine-tuning with implicit policies v± around v_old, and θ_old's decay
schedule. Pure torch. Invariant: at θ = θ_old the gradient is that of advantage-weighted flow matching.
Details: docs/algorithms/nft.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megaflow.flow.forward import noised

__all__ = ["NFTConfig", "nft_loss", "noised", "old_policy_decay", "optimality"]


@dataclass(frozen=True, kw_only=True)
class NFTConfig:
    """DiffusionNFT loss knobs; field names are the ``[algo]`` config keys."""

    nft_beta: float = 1.0
    """β: how far the implicit policies reach from θ_old (the paper's GenEval recipe: 1.0)."""
    adv_clip: float = 5.0
    """c: advantages are clipped to [−c, c]; r = clip(0.5 + A/(2c), 0, 1) and the loss is scaled by c."""
    kl_beta: float = 0.0
    """Weight of the velocity KL to the reference, mean((v_θ − v_ref)²); 0 = no reference."""

    def __post_init__(self) -> None:
        if not (self.nft_beta > 0 and math.isfinite(self.nft_beta)):
            raise ValueError(f"nft_beta must be a positive finite number, got {self.nft_beta!r}")
        if not (self.adv_clip > 0 and math.isfinite(self.adv_clip)):
            raise ValueError(f"adv_clip must be a positive finite number, got {self.adv_clip!r}")
        if not (self.kl_beta >= 0 and math.isfinite(self.kl_beta)):
            raise ValueError(f"kl_beta must be a finite number >= 0, got {self.kl_beta!r}")


def old_policy_decay(steps: int, *, rate: float, max_decay: float, flat_steps: int = 0) -> float:
    """θ_old's decay d after ``steps`` optimizer steps: 0 while steps < ``flat_steps``, then
    min(rate · (steps − flat_steps), max_decay)."""
    if steps < flat_steps:
        return 0.0
    return min(rate * (steps - flat_steps), max_decay)


def optimality(advantages: torch.Tensor, adv_clip: float) -> torch.Tensor:
    """r = clip(0.5 + A / (2·adv_clip), 0, 1): 1 for the best samples, 0 for the worst, 0.5 at A = 0."""
    return (0.5 + advantages.float() / (2.0 * adv_clip)).clamp(0.0, 1.0)


def _expand(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return t.to(like.dtype).view(-1, *([1] * (like.dim() - 1)))


def _self_normalised_error(x0_hat: torch.Tensor, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean((x̂0 − x0)²) / sg(mean|x̂0 − x0|), the weight w) per item; w in float64 as the paper, ≥ 1e-5."""
    dims = tuple(range(1, x0.dim()))
    err = x0_hat - x0
    with torch.no_grad():
        w = err.detach().double().abs().mean(dim=dims).clamp(min=1e-5).to(err.dtype)
    return err.pow(2).mean(dim=dims) / w, w


def nft_loss(velocity: torch.Tensor, old_velocity: torch.Tensor, x0: torch.Tensor, x_t: torch.Tensor,
             t: torch.Tensor, advantages: torch.Tensor, *, config: NFTConfig,
             ref_velocity: torch.Tensor | None = None, mask: torch.Tensor | None = None,
             normalizer: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DiffusionNFT loss of a batch of items: ``velocity`` carries grads, ``old_velocity`` / ``ref_velocity``
    (iff kl_beta > 0) constants; ``t``, ``advantages``, ``mask`` [B]. Returns (loss, detached stats)."""
    if config.kl_beta > 0 and ref_velocity is None:
        raise ValueError(f"kl_beta = {config.kl_beta} > 0 needs ref_velocity")
    b, c = config.nft_beta, config.adv_clip
    mask = torch.ones(velocity.shape[0], dtype=torch.bool, device=velocity.device) if mask is None else mask
    zero = torch.zeros_like
    v = torch.where(_expand(mask, velocity).bool(), velocity.float(), zero(velocity, dtype=torch.float32))
    v_old = torch.where(_expand(mask, v).bool(), old_velocity.detach().float(), zero(v))
    x0f = torch.where(_expand(mask, v).bool(), x0.float(), zero(v))
    xtf = torch.where(_expand(mask, v).bool(), x_t.float(), zero(v))
    te = _expand(t.float(), v)
    r = optimality(torch.where(mask, advantages.float(), zero(advantages, dtype=torch.float32)), c)
    pos, w_pos = _self_normalised_error(xtf - te * (b * v + (1 - b) * v_old), x0f)
    neg, _ = _self_normalised_error(xtf - te * ((1 + b) * v_old - b * v), x0f)
    policy = c * (r * pos + (1 - r) * neg) / b
    dims = tuple(range(1, v.dim()))
    kl = zero(policy)
    if ref_velocity is not None:
        v_ref = torch.where(_expand(mask, v).bool(), ref_velocity.detach().float(), zero(v))
        kl = (v - v_ref).pow(2).mean(dim=dims)
    per_item = policy + config.kl_beta * kl if config.kl_beta > 0 else policy
    count = mask.sum().clamp(min=1).float()
    denom = count if normalizer is None else torch.as_tensor(float(normalizer))
    loss = torch.where(mask, per_item, zero(per_item)).sum() / denom
    mean = lambda x: (torch.where(mask, x.detach().float(), zero(x, dtype=torch.float32)).sum() / count)  # noqa: E731
    stats = {"policy_loss": mean(policy), "kl": mean(kl), "optimality": mean(r), "x0_error": mean(w_pos),
             "old_deviation": mean((v.detach() - v_old).pow(2).mean(dim=dims))}
    return loss, stats
