"""The single Qwen-Image name table: megatron <-> diffusers names, TP split kind, fused-QKV recipe, and the
names of SGLang's native DiT (``engine_tensors``); nothing else spells Qwen-Image parameter names.
Design notes: docs/design/models.md.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

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


_ADDED_QKV = re.compile(r"^(transformer_blocks\.\d+\.attn)\.add_([qkv])_proj\.(weight|bias|lora_[AB]\.weight)$")


def engine_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Diffusers-named tensors as SGLang's Qwen-Image DiT holds them: each block's text projections
    ``add_{q,k,v}_proj`` are its one ``to_added_qkv`` (weights and biases: q, k, v concatenated on the output axis,
    as SGLang packs them when it loads the pipeline; LoRA adapters: the three ``lora_A`` / ``lora_B`` stacked on a
    new first axis, as its LoRA layer holds per-section adapters of equal shape); every other tensor unchanged, in
    order. ValueError when a block's q, k or v is missing at the end."""
    pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        match = _ADDED_QKV.match(name)
        if match is None:
            yield name, tensor
            continue
        key = (match.group(1), match.group(3))
        parts = pending.setdefault(key, {})
        parts[match.group(2)] = tensor.detach().clone()  # the stream's tensor may be reused by the next one
        if len(parts) == 3:
            del pending[key]
            join = torch.stack if key[1].startswith("lora_") else torch.cat
            yield f"{key[0]}.to_added_qkv.{key[1]}", join([parts["q"], parts["k"], parts["v"]])
    if pending:
        raise ValueError(f"Qwen-Image engine tensors: {sorted(pending)[0]} lacks some of add_q/k/v_proj")
