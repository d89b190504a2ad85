"""Masked per-item arithmetic shared by the clean-sample losses (AWM, DGPO): a masked-out item never reaches the
arithmetic (its values are replaced by 0 before use), and a loss is a sum over kept items over a normaliser.
"""
from __future__ import annotations

import torch


def keep_mask(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``mask`` as bools, or all True for ``like``'s items when None."""
    return torch.ones(like.shape[0], dtype=torch.bool, device=like.device) if mask is None else mask.bool()


def select(keep: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in float64 where ``keep`` (per item), else 0."""
    k = keep.view(-1, *([1] * (value.dim() - 1)))
    return torch.where(k, value.double(), torch.zeros((), dtype=torch.float64, device=value.device))


def reduce(per_item: torch.Tensor, keep: torch.Tensor, normalizer: float | None) -> torch.Tensor:
    """The sum of the kept items' values over ``normalizer`` (None: the number of kept items, at least 1)."""
    total = torch.where(keep, per_item, torch.zeros_like(per_item)).sum()
    if normalizer is None:
        return total / keep.sum().clamp(min=1)
    if not float(normalizer) > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer!r}")
    return total / float(normalizer)
