"""Weights must be finite: a pipeline or checkpoint holding NaN or inf is refused where it is loaded.

A DiT whose weights are NaN samples NaN images; the rewards mask them (or score 0) and the run trains on nothing
without saying why. ``refuse_non_finite`` names the first bad tensor in one line instead.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


def refuse_non_finite(named: Iterable[tuple[str, torch.Tensor]], where: str = "") -> None:
    """ValueError (one line naming ``where`` when given and the first tensor with a NaN or inf value, and how
    many) when any floating-point tensor of ``named`` is not finite."""
    for name, tensor in named:
        if not torch.is_floating_point(tensor):
            continue
        bad = int((~torch.isfinite(tensor.detach())).sum())
        if bad:
            raise ValueError(f"{where + ': ' if where else ''}{name} holds {bad} non-finite value(s) (NaN or inf) of {tensor.numel()}; "
                             "these weights are damaged")
