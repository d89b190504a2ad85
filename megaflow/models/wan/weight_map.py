"""The single Wan name table: megatron <-> diffusers names, TP split kind, fused QKV / KV recipes;
nothing else spells Wan's parameter names. Design notes: docs/design/models.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from megaflow.models.common.weight_map import (  # noqa: F401  (shard, stage_layers: re-exported)
    QKV,
    WB,
    Recipe,
    W,
    WeightMap,
    embed_mlp_rows,
    interleave_heads,
    join,
    shard,
    split_heads,
    stage_layers,
)
from megaflow.models.common.weight_map import ParamMap as _BaseParamMap
from megaflow.models.wan.config import WanConfig

TABLE = ("",)  # a bare parameter (the scale-shift tables): no suffix on either side

# (megatron module, diffusers module(s), kind, param suffixes, when) -- top-level modules.
_TOP = (
    ("patch_embed", "patch_embedding", "replicated", WB, "first"),
    *embed_mlp_rows("time_embed", "condition_embedder.time_embedder", "first"),
    ("time_proj", "condition_embedder.time_proj", "replicated", WB, "first"),
    *embed_mlp_rows("text_embed", "condition_embedder.text_embedder", "first"),
    ("final.scale_shift_table", "scale_shift_table", "replicated", TABLE, "last"),
    ("final.proj", "proj_out", "replicated", WB, "last"),
)
# Per block: "layers.{i}." <-> "blocks.{i}."; when: all | cross_norm (cross_attn_norm configured).
_BLOCK = (
    ("scale_shift_table", "scale_shift_table", "replicated", TABLE, "all"),
    ("self_attention.linear_qkv", ("attn1.to_q", "attn1.to_k", "attn1.to_v"), "qkv", WB, "all"),
    ("self_attention.q_layernorm", "attn1.norm_q", "heads", W, "all"),
    ("self_attention.k_layernorm", "attn1.norm_k", "heads", W, "all"),
    ("self_attention.linear_proj", "attn1.to_out.0", "row", WB, "all"),
    ("cross_norm", "norm2", "replicated", WB, "cross_norm"),
    ("cross_attention.linear_q", "attn2.to_q", "column", WB, "all"),
    ("cross_attention.linear_kv", ("attn2.to_k", "attn2.to_v"), "kv", WB, "all"),
    ("cross_attention.q_layernorm", "attn2.norm_q", "heads", W, "all"),
    ("cross_attention.k_layernorm", "attn2.norm_k", "heads", W, "all"),
    ("cross_attention.linear_proj", "attn2.to_out.0", "row", WB, "all"),
    ("mlp.linear_fc1", "ffn.net.0.proj", "column", WB, "all"),
    ("mlp.linear_fc2", "ffn.net.2", "row", WB, "all"),
)


@dataclass(frozen=True)
class ParamMap(_BaseParamMap):
    """The shared ParamMap with Wan's two kinds: ``kv`` (k and v fused per head) and ``heads`` (a q/k norm's
    scale over all heads), both split over TP by heads (dim 0)."""

    @property
    def split_dim(self) -> int | None:
        """TP split dim of the megatron tensor (None = replicated)."""
        if self.kind in ("kv", "heads"):
            return 0
        return super().split_dim


def _maps(table, megatron_prefix: str, diffusers_prefix: str, layer: int | None, config: WanConfig) -> list[ParamMap]:
    out = []
    for mg, df, kind, suffixes, when in table:
        if when == "cross_norm" and not config.cross_attn_norm:
            continue
        dfs = df if isinstance(df, tuple) else (df,)
        stage = when if when in ("first", "last") else "block"
        out += [ParamMap(join(megatron_prefix + mg, s), tuple(join(diffusers_prefix + d, s) for d in dfs), kind,
                         layer, stage) for s in suffixes]
    return out


def param_maps(config: WanConfig) -> list[ParamMap]:
    """Every megatron tensor of the full model (global names), in a stable order."""
    top = _maps(_TOP, "", "", None, config)
    out = [m for m in top if m.stage == "first"]
    for i in range(config.num_layers):
        out += _maps(_BLOCK, f"layers.{i}.", f"blocks.{i}.", i, config)
    return out + [m for m in top if m.stage == "last"]


def _fuse_kv(m: ParamMap, tensors, config: WanConfig):
    return interleave_heads(tensors, config.num_attention_heads)


def _unfuse_kv(m: ParamMap, tensor, config: WanConfig):
    return split_heads(tensor, [tensor.shape[0] // 2] * 2, config.num_attention_heads)


WEIGHTS = WeightMap("Wan", param_maps, recipes={"qkv": QKV, "kv": Recipe(fuse=_fuse_kv, unfuse=_unfuse_kv)})
"""The generic conversions over this table; its methods are this module's public functions."""
split_dim, to_megatron_full = WEIGHTS.split_dim, WEIGHTS.to_megatron_full
to_megatron, select_local = WEIGHTS.to_megatron, WEIGHTS.select_local
megatron_to_diffusers, to_diffusers = WEIGHTS.megatron_to_diffusers, WEIGHTS.to_diffusers
