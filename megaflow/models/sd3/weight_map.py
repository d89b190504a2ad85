"""The single SD3 name table: megatron <-> diffusers names, TP split kind, fused-QKV recipe;
nothing else spells parameter names. Design notes: docs/design/models.md.
"""
from __future__ import annotations

from megaflow.models.common.weight_map import (  # noqa: F401  (re-exported: part of this module's API)
    ADALN_ATTENTION_ROWS,
    ADALN_MLP_ROWS,
    FINAL_ROWS,
    QKV,
    WB,
    ParamMap,
    W,
    WeightMap,
    embed_mlp_rows,
    fuse_qkv,
    join,
    shard,
    stage_layers,
    unfuse_qkv,
)
from megaflow.models.sd3.config import MMDiTConfig

# (megatron module, diffusers module(s), kind, param suffixes, when) -- top-level modules.
_TOP = (
    ("patch_embed.proj", "pos_embed.proj", "replicated", WB, "first"),
    ("patch_embed.pos_embed", "pos_embed.pos_embed", "replicated", ("",), "first"),  # a buffer
    *embed_mlp_rows("time_embed", "time_text_embed.timestep_embedder", "first"),
    *embed_mlp_rows("text_embed", "time_text_embed.text_embedder", "first"),
    ("context_embed", "context_embedder", "replicated", WB, "first"),
    *FINAL_ROWS,
)
# Per block: "layers.{i}." <-> "transformer_blocks.{i}.": the shared adaLN block (whose context
# output exists in all but the last, context_pre_only block) with SD3.5's second, image-only
# attention before the MLP. when (besides the shared all | context_out | qk): dual (a
# dual-attention block) | dual_qk (and q/k norm).
_ATTENTION2 = (
    ("attention2.linear_qkv", ("attn2.to_q", "attn2.to_k", "attn2.to_v"), "qkv", WB, "dual"),
    ("attention2.linear_proj", "attn2.to_out.0", "row", WB, "dual"),
    ("attention2.q_layernorm", "attn2.norm_q", "replicated", W, "dual_qk"),
    ("attention2.k_layernorm", "attn2.norm_k", "replicated", W, "dual_qk"),
)
_BLOCK = ADALN_ATTENTION_ROWS + _ATTENTION2 + ADALN_MLP_ROWS


def _applies(when: str, config: MMDiTConfig, layer: int) -> bool:
    qk, dual = config.qk_norm is not None, layer in config.dual_attention_layers
    return {
        "all": True, "context_out": layer != config.num_layers - 1, "qk": qk, "dual": dual, "dual_qk": dual and qk,
    }[when]


def param_maps(config: MMDiTConfig) -> list[ParamMap]:
    """Every megatron tensor of the full model (global names), in a stable order."""
    out = []
    top = [ParamMap(join(mg, s), (join(df, s),), kind, None, when, s == "")
           for mg, df, kind, suffixes, when in _TOP for s in suffixes]
    out += [m for m in top if m.stage == "first"]
    for i in range(config.num_layers):
        for mg, df, kind, suffixes, when in _BLOCK:
            if not _applies(when, config, i):
                continue
            dfs = df if isinstance(df, tuple) else (df,)
            out += [
                ParamMap(f"layers.{i}.{mg}.{s}", tuple(f"transformer_blocks.{i}.{d}.{s}" for d in dfs), kind, i)
                for s in suffixes
            ]
    return out + [m for m in top if m.stage == "last"]


WEIGHTS = WeightMap("SD3", param_maps, recipes={"qkv": QKV})
"""The generic conversions over this table; its methods are this module's public functions."""
split_dim, to_megatron_full = WEIGHTS.split_dim, WEIGHTS.to_megatron_full
to_megatron, select_local = WEIGHTS.to_megatron, WEIGHTS.select_local
megatron_to_diffusers, to_diffusers = WEIGHTS.megatron_to_diffusers, WEIGHTS.to_diffusers
