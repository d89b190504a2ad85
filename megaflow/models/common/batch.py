"""Trainer microbatch conditioning from rollout trajectories, shared by the families.

``stack_conditioning`` stacks per-sample conditioning along a new batch dim; under CFG the negative
branch comes first (``[negative; positive]``), from the trajectories' ``negative_<key>`` twins.
``packed_grid`` recovers a packed latent grid from its token count and the image size.
"""
from __future__ import annotations

from typing import Sequence

import torch


def stack_conditioning(trajectories: Sequence, keys: Sequence[str], cfg: bool) -> dict[str, torch.Tensor]:
    """``{key: [B, ...]}`` (``[2B, ...]`` = [negative; positive] when ``cfg``) from each trajectory's
    ``conditioning``; ValueError naming the sample that lacks a negative twin or whose twin's shape differs."""
    out = {}
    for key in keys:
        pos = torch.stack([x.conditioning[key] for x in trajectories])
        if cfg:
            missing = [f"{x.request_id}/{x.index}" for x in trajectories if f"negative_{key}" not in x.conditioning]
            if missing:
                raise ValueError(f"trajectory {missing[0]} has do_cfg=True but no 'negative_{key}' in its "
                                 "conditioning: the trainer needs the unconditional branch to recompute CFG")
            neg = torch.stack([x.conditioning[f"negative_{key}"] for x in trajectories])
            if neg.shape != pos.shape:
                raise ValueError(f"negative_{key} shape {tuple(neg.shape[1:])} != {key} shape "
                                 f"{tuple(pos.shape[1:])}: both CFG branches must run as one batch")
            pos = torch.cat([neg, pos])
        out[key] = pos
    return out


def packed_grid(num_tokens: int, height: int, width: int) -> tuple[int, int]:
    """(rows, cols) of the packed latent tokens (FLUX, Qwen-Image) for ``height`` x ``width``: the one scale s
    (2 x VAE factor) giving ``num_tokens``; ValueError when none does."""
    for s in range(1, max(height, width) + 1):
        rows, cols = height // s, width // s
        if rows * cols == num_tokens:
            return rows, cols
        if rows * cols < num_tokens:
            break
    raise ValueError(f"{num_tokens} packed latent tokens fit no grid of a {height}x{width} image")
