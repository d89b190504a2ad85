"""The forward (noising) process of rectified flow and its matching error, shared by the algorithms that train on
clean samples (DiffusionNFT, AWM, DGPO). σ = t: 1 is noise, 0 is data; the velocity target is ε − x0.
"""
from __future__ import annotations

import torch


def noised(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 − t)·x0 + t·ε, ``t`` [B] broadcast over the latent dims."""
    te = t.to(x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
    return (1 - te) * x0 + te * noise


def matching_error(velocity: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """ℓ = mean over the latent's elements of (v − (ε − x0))², per item [B], in float64 (as AWM's and DGPO's
    authors compute it)."""
    err = velocity.double() - (noise.double() - x0.double())
    return err.pow(2).mean(dim=tuple(range(1, err.dim())))
