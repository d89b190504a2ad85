"""The single Qwen-Image name table: megatron <-> diffusers names, TP split kind, fused-QKV recipe;
nothing else spells Qwen-Image parameter names. Design notes: docs/design/models.md.
"""
from __future__ import annotations

from megaflow.models.common.weight_map import (  # noqa: F401  (re-exported: part of this module's API)
    ADALN_ATTENTION_ROWS,
    FINAL_ROWS,
    QKV,
    WB,
    ParamMap,
    W,
    WeightMap,
    block_maps,
    embed_mlp_rows,
    join,
    shard,
    stage_layers,
)
from megaflow.models.qwen_image.config import QwenImageConfig

# (megatron module, diffusers module(s), kind, param suffixes, when) -- top-level modules.
_TOP = (
    ("x_embed", "img_in", "replicated", WB, "first"),
    ("context_norm", "txt_norm", "replicated", W, "first"),
    ("context_embed", "txt_in", "replicated", WB, "first"),
    *embed_mlp_rows("time_embed", "time_text_embed.timestep_embedder", "first"),
    *FINAL_ROWS,
)
# Per block: "layers.{i}." <-> "transformer_blocks.{i}.": the shared adaLN block's attention (every part
# present: q/k norms always on, every block updates its text stream) with Qwen-Image's modulation and MLP names.
_MODULATION = (
    ("adaln", "img_mod.1", "replicated", WB, "all"),
    ("context_adaln", "txt_mod.1", "replicated", WB, "all"),
)
_MLP = (
    ("mlp.linear_fc1", "img_mlp.net.0.proj", "column", WB, "all"),
    ("mlp.linear_fc2", "img_mlp.net.2", "row", WB, "all"),
    ("context_mlp.linear_fc1", "txt_mlp.net.0.proj", "column", WB, "all"),
    ("context_mlp.linear_fc2", "txt_mlp.net.2", "row", WB, "all"),
)
_BLOCK = _MODULATION + tuple(r for r in ADALN_ATTENTION_ROWS if r[0].startswith("attention.")) + _MLP


def param_maps(config: QwenImageConfig) -> list[ParamMap]:
    """Every megatron tensor of the full model (global names), in a stable order."""
    top = [ParamMap(join(mg, s), (join(df, s),), kind, None, when) for mg, df, kind, suffixes, when in _TOP
           for s in suffixes]
    out = [m for m in top if m.stage == "first"]
    for i in range(config.num_layers):
        out += block_maps(_BLOCK, f"layers.{i}.", f"transformer_blocks.{i}.", i)
    return out + [m for m in top if m.stage == "last"]


WEIGHTS = WeightMap("Qwen-Image", param_maps, recipes={"qkv": QKV})
"""The generic conversions over this table; its methods are this module's public functions."""
split_dim, to_megatron_full = WEIGHTS.split_dim, WEIGHTS.to_megatron_full
to_megatron, select_local = WEIGHTS.to_megatron, WEIGHTS.select_local
megatron_to_diffusers, to_diffusers = WEIGHTS.megatron_to_diffusers, WEIGHTS.to_diffusers
