"""Weights must be finite: a pipeline or checkpoint holding NaN or inf is refused where it is loaded,
naming the first bad tensor (NaN weights would sample NaN images and train on nothing, silently).
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
