"""The Wan block on megatron-core (layout [s, b, h]): self-attention with the 3-D rotary embedding,
cross-attention to the text, MLP, modulated by the block's scale-shift table plus the shared time projection.
Invariant: q / k are RMS-normalised over ALL heads' channels (diffusers' ``rms_norm_across_heads``): under TP
each rank holds its heads' slice of the scale and the sum of squares is all-reduced over TP (forward and
backward), so every layout computes the one-rank norm.

Design notes: docs/design/models.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide

from megaflow.models.common.layers import JointAttentionSubmodules, attend, gated_residual
from megaflow.models.common.rope import Rope, apply_rope
from megaflow.models.wan.config import WanConfig


@dataclass
class WanLayerSubmodules:
    """Which class builds each part of a Wan block (see spec.py)."""

    self_attention: ModuleSpec | type
    cross_attention: ModuleSpec | type
    cross_norm: ModuleSpec | type
    mlp: ModuleSpec | type


def _device(config) -> torch.device | None:
    return None if config.use_cpu_initialization else torch.cuda.current_device()


class AcrossHeadsRMSNorm(MegatronModule):
    """RMSNorm over every head's channels (``hidden_size`` = heads * head_dim) of x [..., heads_local, head_dim];
    the scale is split over TP by heads like the projection producing x, the mean square taken over all ranks."""

    def __init__(self, config: WanConfig, hidden_size: int, eps: float = 1e-6):
        super().__init__(config=config)
        self.hidden_size, self.eps = hidden_size, eps
        local = divide(hidden_size, config.tensor_model_parallel_size)
        self.weight = torch.nn.Parameter(torch.ones(local, device=_device(config), dtype=config.params_dtype))
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(-2)
        if self.config.tensor_model_parallel_size == 1:
            return F.rms_norm(flat, (flat.shape[-1],), self.weight, self.eps).view_as(x)
        xf = flat.float()
        # all-reduce in the forward (reduce_from) and of the grad in the backward (copy_to): every rank's
        # channels depend on the sum of squares, so its grad is the sum of the ranks' parts.
        sq = copy_to_tensor_model_parallel_region(reduce_from_tensor_model_parallel_region(
            xf.pow(2).sum(-1, keepdim=True)))
        out = xf * torch.rsqrt(sq / self.hidden_size + self.eps) * self.weight.float()
        return out.to(x.dtype).view_as(x)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The scale as a TP-sharded tensor along dim 0 (it is split by heads)."""
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0}, sharded_offsets,
                                                   tp_group=parallel_state.get_tensor_model_parallel_group())


class _WanAttention(MegatronModule):
    """What both Wan attentions share: heads, q/k norms over all heads, core attention, output projection."""

    def __init__(self, config: WanConfig, submodules: JointAttentionSubmodules, layer_number: int, kind: str):
        super().__init__(config=config)
        c = config
        self.heads_local = divide(c.num_attention_heads, c.tensor_model_parallel_size)
        self.head_dim, inner = c.kv_channels, c.num_attention_heads * c.kv_channels
        self.q_layernorm = build_module(submodules.q_layernorm, config=c, hidden_size=inner, eps=c.layernorm_epsilon)
        self.k_layernorm = build_module(submodules.k_layernorm, config=c, hidden_size=inner, eps=c.layernorm_epsilon)
        self.core_attention = build_module(submodules.core_attention, config=c, layer_number=layer_number,
                                           attn_mask_type=AttnMaskType.no_mask, attention_type=kind)
        self.linear_proj = build_module(
            submodules.linear_proj, inner, c.hidden_size, config=c, init_method=c.output_layer_init_method,
            bias=True, input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_comm_buffer_name="proj")

    def _column(self, submodules: JointAttentionSubmodules, parts: int, name: str):
        c = self.config
        return build_module(
            submodules.linear_qkv, c.hidden_size, parts * c.num_attention_heads * c.kv_channels, config=c,
            init_method=c.init_method, gather_output=False, bias=True, skip_bias_add=False, is_expert=False,
            tp_comm_buffer_name=name)

    def _heads(self, x: torch.Tensor, parts: int) -> tuple[torch.Tensor, ...]:
        """[s, b, heads_local * parts * d] (per head: the parts side by side) -> parts x [s, b, heads_local, d]."""
        s, b = x.shape[:2]
        return x.view(s, b, self.heads_local, parts * self.head_dim).split(self.head_dim, dim=-1)

    def _attend(self, q, k, v):
        """(out, bias) of the output projection for normalised q, k and v."""
        return self.linear_proj(attend(self.core_attention, [q], [k], [v]))


class WanSelfAttention(_WanAttention):
    """attn1: fused QKV, q/k norms over all heads, the 3-D rotary embedding on q and k."""

    def __init__(self, config: WanConfig, submodules: JointAttentionSubmodules, layer_number: int):
        super().__init__(config, submodules, layer_number, "self")
        self.linear_qkv = self._column(submodules, 3, "qkv")

    def forward(self, hidden: torch.Tensor, rope: Rope):
        """hidden [n(/tp), b, h] -> (out, bias); ``rope`` for the n gathered tokens."""
        q, k, v = self._heads(self.linear_qkv(hidden)[0], 3)
        q = apply_rope(self.q_layernorm(q), rope)
        k = apply_rope(self.k_layernorm(k), rope)
        return self._attend(q, k, v)


class WanCrossAttention(_WanAttention):
    """attn2: q from the video tokens, fused KV from the text, q/k norms over all heads, no rotary embedding."""

    def __init__(self, config: WanConfig, submodules: JointAttentionSubmodules, layer_number: int):
        super().__init__(config, submodules, layer_number, "cross")
        self.linear_q = self._column(submodules, 1, "q")
        self.linear_kv = self._column(submodules, 2, "kv")

    def forward(self, hidden: torch.Tensor, context: torch.Tensor):
        """hidden [n(/tp), b, h], context [l(/tp), b, h] -> (out, bias)."""
        (q,) = self._heads(self.linear_q(hidden)[0], 1)
        k, v = self._heads(self.linear_kv(context)[0], 2)
        return self._attend(self.q_layernorm(q), self.k_layernorm(k), v)


class CrossAttentionNorm(torch.nn.Module):
    """diffusers' FP32LayerNorm with scale and bias (``norm2``); its grads are summed over TP under SP."""

    def __init__(self, config: WanConfig):
        super().__init__()
        h, device = config.hidden_size, _device(config)
        self.weight = torch.nn.Parameter(torch.ones(h, device=device, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(h, device=device, dtype=config.params_dtype))
        self.eps = config.layernorm_epsilon
        for p in self.parameters():
            p.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


def scale_shift_table(config: WanConfig, rows: int) -> torch.nn.Parameter:
    """A [1, rows, h] modulation table added to the time projection (replicated; grads summed over TP under SP)."""
    h = config.hidden_size
    table = torch.nn.Parameter(torch.zeros(1, rows, h, device=_device(config), dtype=config.params_dtype))
    if config.perform_initialization:  # diffusers' init: N(0, 1 / h)
        with torch.no_grad():
            table.normal_(0.0, h ** -0.5)
    table.sequence_parallel = True
    return table


def norm_modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm (no affine) in fp32, then x * (1 + scale) + shift, back in x's dtype (diffusers' order)."""
    normed = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    return (normed * (1 + scale) + shift).to(x.dtype)


class WanLayer(MegatronModule):
    """One WanTransformerBlock: modulated self-attention (gated), cross-attention (plain residual), modulated
    MLP (gated); the modulation is ``scale_shift_table`` + the shared time projection (shift, scale, gate of
    the attention, then of the MLP)."""

    def __init__(self, config: WanConfig, submodules: WanLayerSubmodules, layer_number: int):
        super().__init__(config=config)
        self.layer_number = layer_number  # 1-based, global (megatron convention)
        self.scale_shift_table = scale_shift_table(config, 6)
        self.self_attention = build_module(submodules.self_attention, config=config, layer_number=layer_number)
        self.cross_attention = build_module(submodules.cross_attention, config=config, layer_number=layer_number)
        self.cross_norm = build_module(submodules.cross_norm, config=config) if config.cross_attn_norm else None
        self.mlp = build_module(submodules.mlp, config=config, ffn_hidden_size=config.ffn_hidden_size)

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, time_proj: torch.Tensor, rope: Rope):
        """hidden [n(/tp), b, h], context [l(/tp), b, h], time_proj [b, 6, h] -> hidden."""
        eps = self.config.layernorm_epsilon
        shift, scale, gate, mlp_shift, mlp_scale, mlp_gate = (self.scale_shift_table + time_proj.float()).unbind(1)
        out, bias = self.self_attention(norm_modulate(hidden, shift, scale, eps), rope)
        hidden = gated_residual(hidden.float(), gate, (out.float(), bias)).to(hidden.dtype)
        x = self.cross_norm(hidden) if self.cross_norm is not None else hidden
        out, bias = self.cross_attention(x, context)
        hidden = hidden + (out if bias is None else out + bias)
        out, bias = self.mlp(norm_modulate(hidden, mlp_shift, mlp_scale, eps))
        return gated_residual(hidden.float(), mlp_gate, (out.float(), bias)).to(hidden.dtype)
