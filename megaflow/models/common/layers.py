"""DiT building blocks shared by the families, on megatron-core parallel modules (layout [s, b, h]).
The family's ``spec.py`` declares which class builds each part; these classes are the wiring.

Design notes: docs/design/models.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


class ReplicatedLinear(torch.nn.Linear):
    """``nn.Linear`` identical on every TP rank; ``sequence_parallel_grad=True`` marks its parameters
    ``sequence_parallel`` so megatron all-reduces their grads over TP under SP."""

    def __init__(self, in_features: int, out_features: int, *, config: TransformerConfig,
                 bias: bool = True, sequence_parallel_grad: bool = False):
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=config.params_dtype)
        if config.perform_initialization:
            with torch.no_grad():
                config.init_method(self.weight)
                if self.bias is not None:
                    self.bias.zero_()
        for p in self.parameters():
            p.sequence_parallel = sequence_parallel_grad


def _fast_forward_impl(base: type):
    """A ``_forward_impl``: ``F.linear`` when megatron's linear would communicate nothing (TP=1, no SP,
    no grad-accumulation fusion), else ``base``'s own."""

    def _forward_impl(self, input, weight, bias=None, *, gradient_accumulation_fusion=False,
                      allreduce_dgrad=False, sequence_parallel=False, **kwargs):
        if allreduce_dgrad or sequence_parallel or gradient_accumulation_fusion or kwargs.get("grad_output_buffer"):
            return base._forward_impl(
                self, input=input, weight=weight, bias=bias, gradient_accumulation_fusion=gradient_accumulation_fusion,
                allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel, **kwargs)
        return F.linear(input, weight, bias)

    return _forward_impl


class LocalColumnParallelLinear(ColumnParallelLinear):
    """megatron's ColumnParallelLinear running ``F.linear`` at TP=1 (see docs/design/models.md)."""

    _forward_impl = _fast_forward_impl(ColumnParallelLinear)


class LocalRowParallelLinear(RowParallelLinear):
    """megatron's RowParallelLinear with the same ``F.linear`` fast path (see LocalColumnParallelLinear)."""

    _forward_impl = _fast_forward_impl(RowParallelLinear)


class HeadRMSNorm(torch.nn.Module):
    """RMSNorm over the last dim (a head's channels) with a learned scale; TENorm-compatible init."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, device=device, dtype=config.params_dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class SDPAttention(MegatronModule):
    """Core attention via torch SDPA, same interface as megatron's DotProductAttention:
    q, k, v [s, b, heads_local, head_dim] -> [s, b, heads_local * head_dim]; an optional padding
    ``attention_mask`` [b, 1, 1, s] (True: a key nobody attends to, megatron's convention).
    ``input_layout = "bhsd"``: ``attend`` hands over views of contiguous [b, h, s, d] tensors."""

    input_layout = "bhsd"

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, **unused: Any):
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.no_mask, AttnMaskType.padding):
            raise ValueError(f"SDPAttention supports only AttnMaskType.no_mask and .padding, got {attn_mask_type}")
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        assert attention_bias is None and packed_seq_params is None
        s, b, heads, head_dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if attention_mask is None else ~attention_mask,
            dropout_p=self.dropout if self.training else 0.0, scale=self.softmax_scale
        )
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * head_dim)


def attend(core_attention, qs: list[torch.Tensor], ks: list[torch.Tensor], vs: list[torch.Tensor],
           attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """core_attention over the concatenation of per-stream [s_i, b, heads, d] tensors -> [sum s_i, b, heads * d];
    ``attention_mask`` [b, 1, 1, sum s_i] (True: padding, never attended to) switches to a padding mask."""
    if getattr(core_attention, "input_layout", "sbhd") == "bhsd":
        q, k, v = (torch.cat([t.permute(1, 2, 0, 3) for t in ts], dim=2).permute(2, 0, 1, 3) for ts in (qs, ks, vs))
    else:
        q, k, v = (torch.cat(ts) for ts in (qs, ks, vs))
    mask_type = AttnMaskType.no_mask if attention_mask is None else AttnMaskType.padding
    return core_attention(q, k, v, attention_mask=attention_mask, attn_mask_type=mask_type)


@dataclass
class JointAttentionSubmodules:
    """Which class builds each part of a joint attention (see the families' spec.py)."""

    linear_qkv: ModuleSpec | type
    linear_proj: ModuleSpec | type
    core_attention: ModuleSpec | type
    q_layernorm: ModuleSpec | type | None = None
    k_layernorm: ModuleSpec | type | None = None


class JointAttention(MegatronModule):
    """MMDiT attention: fused QKV per stream, one attention over [image; context] tokens.
    ``has_context=False``: image self-attention only; ``context_output=False``: no context output projection.
    ``attn_mask_type``: what the core attention is built for (a subclass that masks padding sets ``padding``)."""

    attn_mask_type = AttnMaskType.no_mask

    def __init__(self, config: TransformerConfig, submodules: JointAttentionSubmodules, layer_number: int,
                 has_context: bool = True, context_output: bool = True):
        super().__init__(config=config)
        self.has_context, self.context_output = has_context, has_context and context_output
        self.heads_local = divide(config.num_attention_heads, config.tensor_model_parallel_size)
        self.head_dim = config.kv_channels
        streams = [""] + (["context_"] if has_context else [])
        for p in streams:
            self.add_module(f"{p}linear_qkv", self._qkv_linear(submodules))
            if p == "" or self.context_output:
                self.add_module(f"{p}linear_proj", self._proj_linear(submodules))
            if config.qk_layernorm:
                for n in ("q", "k"):
                    spec = getattr(submodules, f"{n}_layernorm")
                    norm = build_module(spec, config=config, hidden_size=self.head_dim,
                                        eps=config.layernorm_epsilon)
                    self.add_module(f"{p}{n}_layernorm", norm)
        self.core_attention = build_module(
            submodules.core_attention, config=config, layer_number=layer_number,
            attn_mask_type=self.attn_mask_type, attention_type="self",
        )

    def _qkv_linear(self, submodules):
        c = self.config
        return build_module(
            submodules.linear_qkv, c.hidden_size, 3 * c.num_attention_heads * c.kv_channels,
            config=c, init_method=c.init_method, gather_output=False, bias=True,
            skip_bias_add=False, is_expert=False, tp_comm_buffer_name="qkv",
        )

    def _proj_linear(self, submodules):
        c = self.config
        return build_module(
            submodules.linear_proj, c.num_attention_heads * c.kv_channels, c.hidden_size,
            config=c, init_method=c.output_layer_init_method, bias=True, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name="proj",
        )

    def _project(self, x: torch.Tensor, prefix: str):
        """[s, b, h] -> q, k, v each [s, b, heads_local, head_dim] (q/k normalised if configured)."""
        mixed, _ = getattr(self, f"{prefix}linear_qkv")(x)
        s, b = mixed.shape[:2]
        q, k, v = mixed.view(s, b, self.heads_local, 3 * self.head_dim).split(self.head_dim, dim=-1)
        if self.config.qk_layernorm:
            q = getattr(self, f"{prefix}q_layernorm")(q)
            k = getattr(self, f"{prefix}k_layernorm")(k)
        return q, k, v

    def forward(self, hidden: torch.Tensor, context: torch.Tensor | None = None):
        """Returns ``(image_out, image_bias), (context_out, context_bias)``; biases un-added so the
        caller can fuse them with the gate. Context outputs are None without a context projection."""
        streams = [self._project(hidden, "")]
        num_image = streams[0][0].shape[0]
        if self.has_context:
            streams.append(self._project(context, "context_"))
        out = attend(self.core_attention, *([st[i] for st in streams] for i in range(3)))
        image = self.linear_proj(out[:num_image])
        ctx = self.context_linear_proj(out[num_image:]) if self.context_output else (None, None)
        return image, ctx


class MMDiTMLP(MegatronModule):
    """fc1 (column-parallel, bias in the GEMM) -> GELU(tanh) -> fc2 (row-parallel, bias returned):
    diffusers' FeedForward(dim, mult=4, "gelu-approximate"), with megatron MLP's names and layout."""

    def __init__(self, config: TransformerConfig, submodules, ffn_hidden_size: int | None = None):
        super().__init__(config=config)
        ffn = ffn_hidden_size or config.ffn_hidden_size
        self.linear_fc1 = build_module(
            submodules.linear_fc1, config.hidden_size, ffn, config=config, init_method=config.init_method,
            gather_output=False, bias=True, skip_bias_add=False, is_expert=False, tp_comm_buffer_name="fc1")
        self.linear_fc2 = build_module(
            submodules.linear_fc2, ffn, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=True, input_is_parallel=True,
            skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2")

    def forward(self, x: torch.Tensor):
        """[s, b, h] -> (out [s, b, h], fc2 bias or None)."""
        hidden, _ = self.linear_fc1(x)
        return self.linear_fc2(self.config.activation_func(hidden))


@dataclass
class AdaLNBlockSubmodules:
    """Which class builds each part of an adaLN-Zero double-stream block (SD3's MMDiT block,
    FLUX's double-stream block); both streams use the same classes."""

    adaln: ModuleSpec | type
    attention: ModuleSpec | type
    mlp: ModuleSpec | type


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim without affine parameters (adaLN supplies scale and shift)."""
    return F.layer_norm(x, (x.shape[-1],), eps=eps)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x * (1 + scale) + shift with [b, h] modulation broadcast over the sequence dim of x [s, b, h]."""
    return torch.addcmul(shift, x, 1 + scale)


def gated_residual(residual, gate, out_and_bias):
    """residual + gate * (out + bias), bias optional."""
    out, bias = out_and_bias
    if bias is not None:
        out = out + bias
    return torch.addcmul(residual, gate, out)
