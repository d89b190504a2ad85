"""Rotary position embeddings over several position axes (FLUX.1's ids, Wan's frame / row / column grid).
Layout [s, b, heads, d]; a rope table is (cos, sin) per token with each frequency repeated twice, rotating
channel pairs (2i, 2i+1).

Design notes: docs/design/models.md.
"""
from __future__ import annotations

import torch

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [tokens, head_dim] float32


def rope_table(ids: torch.Tensor, axes_dims: tuple[int, ...], theta: float, dtype: torch.dtype = torch.float64) -> Rope:
    """cos, sin [tokens, sum(axes_dims)] for position ids [tokens, axes]: per axis the frequencies
    1 / theta^(2i/dim) and angles position * frequency computed in ``dtype`` (diffusers: float64 for FLUX
    and Wan), each frequency repeated twice, axes concatenated; returned as float32."""
    cos, sin = [], []
    for axis, dim in enumerate(axes_dims):
        freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=dtype, device=ids.device) / dim))
        angles = torch.outer(ids[:, axis].float().to(dtype), freqs)
        cos.append(angles.cos().repeat_interleave(2, dim=1).float())
        sin.append(angles.sin().repeat_interleave(2, dim=1).float())
    return torch.cat(cos, dim=-1), torch.cat(sin, dim=-1)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate channel pairs (2i, 2i+1) of x [s, b, heads, d] by the per-token angles (fp32 math)."""
    cos, sin = (t[:, None, None, :] for t in rope)
    real, imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
