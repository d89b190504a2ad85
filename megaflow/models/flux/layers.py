"""FLUX.1 blocks on megatron-core (layout [s, b, h]): the two block kinds with rotary embeddings;
shared pieces are in ``megaflow.models.common.layers`` and ``megaflow.models.common.rope``.

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

from megaflow.models.common.layers import (
    AdaLNBlockSubmodules,
    JointAttention,
    attend,
    gated_residual,
    layer_norm,
    modulate,
)
from megaflow.models.common.rope import Rope, apply_rope, rope_table  # noqa: F401  (rope_table: re-exported)
from megaflow.models.flux.config import FluxConfig


@dataclass
class FluxRope:
    """RoPE tables for one forward: per stream for double blocks, joint order for single blocks."""

    image: Rope
    context: Rope
    joint: Rope


class FluxJointAttention(JointAttention):
    """The shared joint attention with RoPE on q and k; tokens attended as ``[context; image]``."""

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, rope: FluxRope):
        """Returns ``(image_out, image_bias), (context_out, context_bias)`` (biases un-added)."""
        qi, ki, vi = self._project(hidden, "")
        qc, kc, vc = self._project(context, "context_")
        out = attend(self.core_attention, [apply_rope(qc, rope.context), apply_rope(qi, rope.image)],
                     [apply_rope(kc, rope.context), apply_rope(ki, rope.image)], [vc, vi])
        num_context = qc.shape[0]
        return self.linear_proj(out[num_context:]), self.context_linear_proj(out[:num_context])


FluxDoubleLayerSubmodules = AdaLNBlockSubmodules  # the FLUX name of the shared submodule table


class FluxDoubleLayer(MegatronModule):
    """One FluxTransformerBlock: adaLN-Zero (6h per stream), joint attention with RoPE, MLP per stream."""

    single = False

    def __init__(self, config: FluxConfig, submodules: AdaLNBlockSubmodules, layer_number: int):
        super().__init__(config=config)
        self.layer_number = layer_number  # 1-based, global (megatron convention)
        h = config.hidden_size
        self.adaln = build_module(submodules.adaln, h, 6 * h, config=config, sequence_parallel_grad=True)
        self.context_adaln = build_module(submodules.adaln, h, 6 * h, config=config, sequence_parallel_grad=True)
        self.attention = build_module(submodules.attention, config=config, layer_number=layer_number)
        self.mlp = build_module(submodules.mlp, config=config, ffn_hidden_size=config.ffn_hidden_size)
        self.context_mlp = build_module(submodules.mlp, config=config, ffn_hidden_size=config.ffn_hidden_size)

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, temb: torch.Tensor, rope: FluxRope):
        """hidden [n, b, h], context [l, b, h], temb [b, h] -> (hidden, context)."""
        eps = self.config.layernorm_epsilon
        emb = F.silu(temb)
        mod = self.adaln(emb).chunk(6, dim=-1)  # shift, scale, gate (attn); shift, scale, gate (mlp)
        cmod = self.context_adaln(emb).chunk(6, dim=-1)
        x = modulate(layer_norm(hidden, eps), mod[0], mod[1])
        c = modulate(layer_norm(context, eps), cmod[0], cmod[1])
        image_attn, context_attn = self.attention(x, c, rope)
        hidden = gated_residual(hidden, mod[2], image_attn)
        hidden = gated_residual(hidden, mod[5], self.mlp(modulate(layer_norm(hidden, eps), mod[3], mod[4])))
        context = gated_residual(context, cmod[2], context_attn)
        context = gated_residual(context, cmod[5],
                                  self.context_mlp(modulate(layer_norm(context, eps), cmod[3], cmod[4])))
        return hidden, context


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
