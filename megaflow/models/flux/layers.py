"""FLUX.1 blocks on megatron-core (layout [s, b, h]): the single-stream block; the double-stream block and
the rotary embeddings are the shared ones of ``megaflow.models.common.rope``.

Design notes: docs/design/models.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.utils import divide

from megaflow.models.common.layers import AdaLNBlockSubmodules, attend, gated_residual, layer_norm, modulate
from megaflow.models.common.rope import Rope, RopeDoubleLayer, RopeJointAttention, StreamRope, apply_rope, rope_table
from megaflow.models.flux.config import FluxConfig

__all__ = ["FluxDoubleLayer", "FluxJointAttention", "FluxRope", "FluxSingleLayer", "FluxSingleLayerSubmodules",
           "Rope", "apply_rope", "rope_table"]


@dataclass
class FluxRope(StreamRope):
    """RoPE tables for one forward: per stream for double blocks, joint order for single blocks."""

    joint: Rope


FluxJointAttention = RopeJointAttention  # tokens attended as [context; image], as diffusers' FLUX
FluxDoubleLayerSubmodules = AdaLNBlockSubmodules  # the FLUX name of the shared submodule table
FluxDoubleLayer = RopeDoubleLayer  # one FluxTransformerBlock


@dataclass
class FluxSingleLayerSubmodules:
    """Which class builds each part of a single-stream block (see the fused layouts above)."""

    adaln: ModuleSpec | type
    linear_qkv_mlp: ModuleSpec | type
    linear_proj: ModuleSpec | type
    core_attention: ModuleSpec | type
    q_layernorm: ModuleSpec | type
    k_layernorm: ModuleSpec | type


class FluxSingleLayer(MegatronModule):
    """One FluxSingleTransformerBlock over ``[context; image]``: modulated LN, fused [q k v | m],
    out = proj([attn | gelu(m)]), x + gate * out."""

    single = True

    def __init__(self, config: FluxConfig, submodules: FluxSingleLayerSubmodules, layer_number: int):
        super().__init__(config=config)
        self.layer_number = layer_number
        c, h = config, config.hidden_size
        self.heads_local = divide(c.num_attention_heads, c.tensor_model_parallel_size)
        self.head_dim, self.mlp_per_head = c.kv_channels, c.mlp_per_head
        self.adaln = build_module(submodules.adaln, h, 3 * h, config=c, sequence_parallel_grad=True)
        self.linear_qkv_mlp = build_module(
            submodules.linear_qkv_mlp, h, c.num_attention_heads * (3 * self.head_dim + self.mlp_per_head),
            config=c, init_method=c.init_method, gather_output=False, bias=True, skip_bias_add=False,
            is_expert=False, tp_comm_buffer_name="qkv")
        self.linear_proj = build_module(
            submodules.linear_proj, c.num_attention_heads * (self.head_dim + self.mlp_per_head), h,
            config=c, init_method=c.output_layer_init_method, bias=True, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name="proj")
        self.q_layernorm = build_module(submodules.q_layernorm, config=c, hidden_size=self.head_dim,
                                        eps=c.layernorm_epsilon)
        self.k_layernorm = build_module(submodules.k_layernorm, config=c, hidden_size=self.head_dim,
                                        eps=c.layernorm_epsilon)
        self.core_attention = build_module(submodules.core_attention, config=c, layer_number=layer_number,
                                           attn_mask_type=AttnMaskType.no_mask, attention_type="self")

    def forward(self, joint: torch.Tensor, temb: torch.Tensor, rope: Rope):
        """joint [l + n, b, h] (local shard with SP), temb [b, h], rope in gathered token order."""
        shift, scale, gate = self.adaln(F.silu(temb)).chunk(3, dim=-1)
        x = modulate(layer_norm(joint, self.config.layernorm_epsilon), shift, scale)
        fused, _ = self.linear_qkv_mlp(x)
        s, b = fused.shape[:2]
        d = self.head_dim
        q, k, v, m = fused.view(s, b, self.heads_local, 3 * d + self.mlp_per_head).split(
            [d, d, d, self.mlp_per_head], dim=-1)
        q = apply_rope(self.q_layernorm(q), rope)
        k = apply_rope(self.k_layernorm(k), rope)
        attn = attend(self.core_attention, [q], [k], [v]).view(s, b, self.heads_local, d)
        mixed = torch.cat([attn, self.config.activation_func(m)], dim=-1).view(s, b, -1)
        return gated_residual(joint, gate, self.linear_proj(mixed))
