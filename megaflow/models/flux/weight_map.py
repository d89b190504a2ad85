"""The single FLUX.1 name table: megatron <-> diffusers names, TP split dim, fused recipes.
Design notes: docs/design/models.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megaflow.models.common.weight_map import (
    ADALN_ATTENTION_ROWS,
    ADALN_MLP_ROWS,
    FINAL_ROWS,
    QKV,
    WB,
    Recipe,
    W,
    WeightMap,
    block_maps,
    embed_mlp_rows,
    interleave_heads,
    join,
    split_heads,
)
from megaflow.models.common.weight_map import ParamMap as _BaseParamMap
from megaflow.models.common.weight_map import shard, stage_layers  # noqa: F401  (re-exported)
from megaflow.models.flux.config import FluxConfig

__all__ = [
    "ParamMap", "param_maps", "split_dim", "interleave_heads", "split_heads", "to_megatron_full",
    "megatron_to_diffusers", "to_diffusers", "stage_layers", "shard", "to_megatron", "select_local",
]

# (megatron module, diffusers module(s), kind, param suffixes, when) -- top-level modules.
_TOP = (
    ("x_embed", "x_embedder", "replicated", WB, "first"),
    ("context_embed", "context_embedder", "replicated", WB, "first"),
    *embed_mlp_rows("time_embed", "time_text_embed.timestep_embedder", "first"),
    *embed_mlp_rows("guidance_embed", "time_text_embed.guidance_embedder", "guidance"),
    *embed_mlp_rows("text_embed", "time_text_embed.text_embedder", "first"),
    *FINAL_ROWS,
)
# Double-stream block: "layers.{i}." <-> "transformer_blocks.{i}.": the shared adaLN block, every
# part present (q/k norms always on; every block updates its context stream).
_DOUBLE = ADALN_ATTENTION_ROWS + ADALN_MLP_ROWS
# Single-stream block: "layers.{D + j}." <-> "single_transformer_blocks.{j}.".
_SINGLE = (
    ("adaln", "norm.linear", "replicated", WB, "all"),
    ("linear_qkv_mlp", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), "qkv_mlp", WB, "all"),
    ("q_layernorm", "attn.norm_q", "replicated", W, "all"),
    ("k_layernorm", "attn.norm_k", "replicated", W, "all"),
    ("linear_proj", "proj_out", "attn_mlp", WB, "all"),
)


@dataclass(frozen=True)
class ParamMap(_BaseParamMap):
    """The shared ParamMap (megatron name, diffusers name(s), kind, layer, stage, buffer) with the
    two single-block kinds added to ``split_dim``."""

    @property
    def split_dim(self) -> int | None:
        """TP split dim of the megatron tensor (None = replicated)."""
        if self.kind == "qkv_mlp":
            return 0
        if self.kind == "attn_mlp":
            return 1 if self.megatron.endswith(".weight") else None
        return super().split_dim


def param_maps(config: FluxConfig) -> list[ParamMap]:
    """Every megatron tensor of the full model (global names), in a stable order."""
    stages = {"first": "first", "guidance": "first", "last": "last"}
    top = [ParamMap(join(mg, s), (join(df, s),), kind, None, stages[when])
           for mg, df, kind, suffixes, when in _TOP for s in suffixes
           if when != "guidance" or config.guidance_embeds]
    out = [m for m in top if m.stage == "first"]
    for i in range(config.num_layers):
        if config.is_single(i):
            out += block_maps(_SINGLE, f"layers.{i}.", f"single_transformer_blocks.{i - config.num_double_layers}.", i,
                              ParamMap)
        else:
            out += block_maps(_DOUBLE, f"layers.{i}.", f"transformer_blocks.{i}.", i, ParamMap)
    return out + [m for m in top if m.stage == "last"]


def _fuse_qkv_mlp(m: ParamMap, tensors: list[torch.Tensor], config: FluxConfig) -> torch.Tensor:
    return interleave_heads(tensors, config.num_attention_heads)


def _unfuse_qkv_mlp(m: ParamMap, tensor: torch.Tensor, config: FluxConfig) -> list[torch.Tensor]:
    width = config.hidden_size
    return split_heads(tensor, [width, width, width, config.ffn_hidden_size], config.num_attention_heads)


def _fuse_attn_mlp(m: ParamMap, tensors: list[torch.Tensor], config: FluxConfig) -> torch.Tensor:
    (t,) = tensors
    if not m.megatron.endswith(".weight"):
        return t  # the bias is not fused
    width = config.hidden_size
    return interleave_heads([t[:, :width], t[:, width:]], config.num_attention_heads, dim=1)


def _unfuse_attn_mlp(m: ParamMap, tensor: torch.Tensor, config: FluxConfig) -> list[torch.Tensor]:
    if not m.megatron.endswith(".weight"):
        return [tensor]
    parts = split_heads(tensor, [config.hidden_size, config.ffn_hidden_size], config.num_attention_heads, dim=1)
    return [torch.cat(parts, dim=1)]


RECIPES = {
    "qkv": QKV,
    "qkv_mlp": Recipe(fuse=_fuse_qkv_mlp, unfuse=_unfuse_qkv_mlp),
    "attn_mlp": Recipe(fuse=_fuse_attn_mlp, unfuse=_unfuse_attn_mlp),
}
WEIGHTS = WeightMap("FLUX", param_maps, RECIPES)
"""The generic conversions over this table; its methods are this module's public functions."""
split_dim, to_megatron_full = WEIGHTS.split_dim, WEIGHTS.to_megatron_full
to_megatron, select_local = WEIGHTS.to_megatron, WEIGHTS.select_local
megatron_to_diffusers, to_diffusers = WEIGHTS.megatron_to_diffusers, WEIGHTS.to_diffusers
