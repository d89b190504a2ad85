"""Rotary position embeddings over several position axes (FLUX.1's ids, Qwen-Image's, Wan's frame / row / column
grid) and the RoPE double-stream (MMDiT) block that applies them (FLUX.1's double-stream block, Qwen-Image's block). Layout [s, b, h]; a rope table is
(cos, sin) per token with each frequency repeated twice, rotating channel pairs (2i, 2i+1).

Design notes: docs/design/models.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module

from megaflow.models.common.layers import (
    AdaLNBlockSubmodules,
    JointAttention,
    attend,
    gated_residual,
    layer_norm,
    modulate,
)

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [tokens, head_dim] float32


@dataclass
class StreamRope:
    """The RoPE tables of the two streams of a double-stream block."""

    image: Rope
    context: Rope


def rope_table(ids: torch.Tensor, axes_dims: tuple[int, ...], theta: float, dtype: torch.dtype = torch.float64) -> Rope:
    """cos, sin [tokens, sum(axes_dims)] for position ids [tokens, axes]: per axis the frequencies
    1 / theta^(2i/dim) and angles position * frequency computed in ``dtype`` (diffusers: float64 for FLUX,
    float32 for Qwen-Image, float64 for Wan), each frequency repeated twice, axes concatenated; returned as float32."""
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


class RopeJointAttention(JointAttention):
    """The shared joint attention with RoPE on q and k. Tokens are attended as ``[context; image]``
    (``context_first``, FLUX) or ``[image; context]``; ``attention_mask`` [b, 1, 1, tokens] (True: a key
    nobody attends to, megatron's convention) is in that order."""

    context_first = True

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, rope: StreamRope,
                attention_mask: torch.Tensor | None = None):
        """Returns ``(image_out, image_bias), (context_out, context_bias)`` (biases un-added)."""
        qi, ki, vi = self._project(hidden, "")
        qc, kc, vc = self._project(context, "context_")
        image = (apply_rope(qi, rope.image), apply_rope(ki, rope.image), vi)
        ctx = (apply_rope(qc, rope.context), apply_rope(kc, rope.context), vc)
        first, second = (ctx, image) if self.context_first else (image, ctx)
        out = attend(self.core_attention, *([first[i], second[i]] for i in range(3)), attention_mask=attention_mask)
        num_context, num_image = qc.shape[0], qi.shape[0]
        image_out, context_out = (out[num_context:], out[:num_context]) if self.context_first else \
            (out[:num_image], out[num_image:])
        return self.linear_proj(image_out), self.context_linear_proj(context_out)


class RopeDoubleLayer(MegatronModule):
    """One double-stream block: adaLN-Zero (6h per stream: shift, scale, gate for attention, then for
    the MLP), joint attention with RoPE, MLP per stream; both streams updated."""

    single = False

    def __init__(self, config, submodules: AdaLNBlockSubmodules, layer_number: int):
        super().__init__(config=config)
        self.layer_number = layer_number  # 1-based, global (megatron convention)
        h = config.hidden_size
        self.adaln = build_module(submodules.adaln, h, 6 * h, config=config, sequence_parallel_grad=True)
        self.context_adaln = build_module(submodules.adaln, h, 6 * h, config=config, sequence_parallel_grad=True)
        self.attention = build_module(submodules.attention, config=config, layer_number=layer_number)
        self.mlp = build_module(submodules.mlp, config=config, ffn_hidden_size=config.ffn_hidden_size)
        self.context_mlp = build_module(submodules.mlp, config=config, ffn_hidden_size=config.ffn_hidden_size)

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, temb: torch.Tensor, rope: StreamRope,
                attention_mask: torch.Tensor | None = None):
        """hidden [n, b, h], context [l, b, h], temb [b, h] -> (hidden, context)."""
        eps = self.config.layernorm_epsilon
        emb = F.silu(temb)
        mod = self.adaln(emb).chunk(6, dim=-1)  # shift, scale, gate (attn); shift, scale, gate (mlp)
        cmod = self.context_adaln(emb).chunk(6, dim=-1)
        x = modulate(layer_norm(hidden, eps), mod[0], mod[1])
        c = modulate(layer_norm(context, eps), cmod[0], cmod[1])
        image_attn, context_attn = self.attention(x, c, rope, attention_mask)
        hidden = gated_residual(hidden, mod[2], image_attn)
        hidden = gated_residual(hidden, mod[5], self.mlp(modulate(layer_norm(hidden, eps), mod[3], mod[4])))
        context = gated_residual(context, cmod[2], context_attn)
        context = gated_residual(context, cmod[5],
                                  self.context_mlp(modulate(layer_norm(context, eps), cmod[3], cmod[4])))
        return hidden, context
