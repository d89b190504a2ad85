"""The single FLUX.1 name table: megatron name <-> diffusers name, TP split dim, fused recipes.

Same interface as ``megaflow.models.sd3.weight_map`` (param_maps, split_dim, to_megatron_full,
megatron_to_diffusers, to_diffusers, stage_layers, to_megatron, select_local), so the trainer,
the bridge and tools/convert_checkpoint.py work unchanged for family "flux". Megatron names are
GLOBAL (``layers.<global block index>.``): double-stream block i is ``layers.i`` <->
``transformer_blocks.i``; single-stream block j is ``layers.<D + j>`` <->
``single_transformer_blocks.j`` (D = number of double-stream blocks).

Kinds (the TP plan; reasons in ``layers.py``):
    replicated  same tensor on every TP rank
    column      split on dim 0 (weight and bias)
    row         weight split on dim 1, bias replicated
    qkv         diffusers q, k, v [H, h] fused into [3H, h], rows interleaved per head
                ``[h0: q k v | h1: q k v | ...]`` (SD3's recipe), split on dim 0
    qkv_mlp     single block: diffusers to_q, to_k, to_v [H, h] and proj_mlp [F, h] fused into
                [3H + F, h], rows interleaved per head ``[h0: q k v m0 | h1: q k v m1 | ...]``
                (m_i = rows i*F/heads .. (i+1)*F/heads of proj_mlp), split on dim 0
    attn_mlp    single block: diffusers proj_out [h, H + F] (columns [attn | mlp]) with its
                columns interleaved per head ``[h0: attn m0 | h1: attn m1 | ...]``; weight split
                on dim 1, bias replicated
Every megatron tensor maps to whole diffusers tensors (streaming-friendly), and no full megatron
tensor depends on the TP degree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megaflow.models.flux.config import FluxConfig
from megaflow.models.sd3.weight_map import ParamMap as _SD3ParamMap
from megaflow.models.sd3.weight_map import fuse_qkv, shard, stage_layers, unfuse_qkv

__all__ = [
    "ParamMap", "param_maps", "split_dim", "interleave_heads", "split_heads", "to_megatron_full",
    "megatron_to_diffusers", "to_diffusers", "stage_layers", "shard", "to_megatron", "select_local",
]

W, WB = ("weight",), ("weight", "bias")

# (megatron module, diffusers module, kind, param suffixes, stage) -- top-level modules.
_TOP = (
    ("x_embed", "x_embedder", "replicated", WB, "first"),
    ("context_embed", "context_embedder", "replicated", WB, "first"),
    ("time_embed.linear_1", "time_text_embed.timestep_embedder.linear_1", "replicated", WB, "first"),
    ("time_embed.linear_2", "time_text_embed.timestep_embedder.linear_2", "replicated", WB, "first"),
    ("guidance_embed.linear_1", "time_text_embed.guidance_embedder.linear_1", "replicated", WB, "guidance"),
    ("guidance_embed.linear_2", "time_text_embed.guidance_embedder.linear_2", "replicated", WB, "guidance"),
    ("text_embed.linear_1", "time_text_embed.text_embedder.linear_1", "replicated", WB, "first"),
    ("text_embed.linear_2", "time_text_embed.text_embedder.linear_2", "replicated", WB, "first"),
    ("final_adaln", "norm_out.linear", "replicated", WB, "last"),
    ("final_proj", "proj_out", "replicated", WB, "last"),
)
# Double-stream block: "layers.{i}." <-> "transformer_blocks.{i}.".
_DOUBLE = (
    ("adaln", "norm1.linear", "replicated", WB),
    ("context_adaln", "norm1_context.linear", "replicated", WB),
    ("attention.linear_qkv", ("attn.to_q", "attn.to_k", "attn.to_v"), "qkv", WB),
    ("attention.linear_proj", "attn.to_out.0", "row", WB),
    ("attention.context_linear_qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), "qkv", WB),
    ("attention.context_linear_proj", "attn.to_add_out", "row", WB),
    ("attention.q_layernorm", "attn.norm_q", "replicated", W),
    ("attention.k_layernorm", "attn.norm_k", "replicated", W),
    ("attention.context_q_layernorm", "attn.norm_added_q", "replicated", W),
    ("attention.context_k_layernorm", "attn.norm_added_k", "replicated", W),
    ("mlp.linear_fc1", "ff.net.0.proj", "column", WB),
    ("mlp.linear_fc2", "ff.net.2", "row", WB),
    ("context_mlp.linear_fc1", "ff_context.net.0.proj", "column", WB),
    ("context_mlp.linear_fc2", "ff_context.net.2", "row", WB),
)
# Single-stream block: "layers.{D + j}." <-> "single_transformer_blocks.{j}.".
_SINGLE = (
    ("adaln", "norm.linear", "replicated", WB),
    ("linear_qkv_mlp", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), "qkv_mlp", WB),
    ("q_layernorm", "attn.norm_q", "replicated", W),
    ("k_layernorm", "attn.norm_k", "replicated", W),
    ("linear_proj", "proj_out", "attn_mlp", WB),
)


@dataclass(frozen=True)
class ParamMap(_SD3ParamMap):
    """SD3's ParamMap (megatron name, diffusers name(s), kind, layer, stage, buffer) with the two
    single-block kinds added to ``split_dim``."""

    @property
    def split_dim(self) -> int | None:
        """TP split dim of the megatron tensor (None = replicated)."""
        if self.kind == "qkv_mlp":
            return 0
        if self.kind == "attn_mlp":
            return 1 if self.megatron.endswith(".weight") else None
        return super().split_dim


def _join(module: str, suffix: str) -> str:
    return f"{module}.{suffix}" if suffix else module


def _block_maps(table, megatron_prefix: str, diffusers_prefix: str, layer: int) -> list[ParamMap]:
    out = []
    for mg, df, kind, suffixes in table:
        dfs = df if isinstance(df, tuple) else (df,)
        out += [ParamMap(f"{megatron_prefix}{mg}.{s}", tuple(f"{diffusers_prefix}{d}.{s}" for d in dfs), kind, layer)
                for s in suffixes]
    return out


def param_maps(config: FluxConfig) -> list[ParamMap]:
    """Every megatron tensor of the full model (global names), in a stable order."""
    stages = {"first": "first", "guidance": "first", "last": "last"}
    top = [ParamMap(_join(mg, s), (_join(df, s),), kind, None, stages[when])
           for mg, df, kind, suffixes, when in _TOP for s in suffixes
           if when != "guidance" or config.guidance_embeds]
    out = [m for m in top if m.stage == "first"]
    for i in range(config.num_layers):
        if config.is_single(i):
            out += _block_maps(_SINGLE, f"layers.{i}.", f"single_transformer_blocks.{i - config.num_double_layers}.", i)
        else:
            out += _block_maps(_DOUBLE, f"layers.{i}.", f"transformer_blocks.{i}.", i)
    return out + [m for m in top if m.stage == "last"]


def _by_megatron(config: FluxConfig) -> dict[str, ParamMap]:
    return {m.megatron: m for m in param_maps(config)}


def split_dim(config: FluxConfig, megatron_name: str) -> int | None:
    """TP split dim of a global megatron tensor name (ValueError for an unknown name)."""
    m = _by_megatron(config).get(megatron_name)
    if m is None:
        raise ValueError(f"unknown megatron tensor {megatron_name!r} for this FLUX config")
    return m.split_dim


def interleave_heads(parts: list[torch.Tensor], num_heads: int, dim: int = 0) -> torch.Tensor:
    """Concatenate ``parts`` along ``dim`` per head: each part is cut into ``num_heads`` equal
    slices along ``dim`` and the result is ``[p0_h0 p1_h0 ... | p0_h1 p1_h1 ... | ...]``."""
    if any(p.shape[dim] % num_heads for p in parts):
        raise ValueError(f"sizes {[p.shape[dim] for p in parts]} along dim {dim} are not divisible by {num_heads} heads")
    per_head = [p.unflatten(dim, (num_heads, -1)) for p in parts]
    return torch.cat(per_head, dim=dim + 1).flatten(dim, dim + 1)


def split_heads(fused: torch.Tensor, sizes: list[int], num_heads: int, dim: int = 0) -> list[torch.Tensor]:
    """Inverse of ``interleave_heads``: ``sizes`` are the parts' full sizes along ``dim``."""
    per_head = fused.unflatten(dim, (num_heads, -1)).split([s // num_heads for s in sizes], dim=dim + 1)
    return [p.flatten(dim, dim + 1).contiguous() for p in per_head]


def _fuse(m: ParamMap, tensors: list[torch.Tensor], config: FluxConfig) -> torch.Tensor:
    heads, width = config.num_attention_heads, config.hidden_size
    if m.kind == "qkv":
        return fuse_qkv(*tensors, heads)
    if m.kind == "qkv_mlp":
        return interleave_heads(tensors, heads)
    if m.kind == "attn_mlp" and m.megatron.endswith(".weight"):
        (w,) = tensors
        return interleave_heads([w[:, :width], w[:, width:]], heads, dim=1)
    return tensors[0]


def to_megatron_full(diffusers_sd: dict[str, torch.Tensor], config: FluxConfig) -> dict[str, torch.Tensor]:
    """Full (un-split) megatron state dict with global names from a diffusers state dict.

    ValueError names the first missing or unexpected diffusers tensor (a wrong architecture)."""
    maps = param_maps(config)
    expected = {d for m in maps for d in m.diffusers}
    missing = [d for m in maps for d in m.diffusers if d not in diffusers_sd]
    if missing:
        raise ValueError(f"diffusers tensor {missing[0]!r} is missing (config does not match the weights)")
    unexpected = [k for k in diffusers_sd if k not in expected]
    if unexpected:
        raise ValueError(f"unexpected diffusers tensor {unexpected[0]!r} (config does not match the weights)")
    return {m.megatron: _fuse(m, [diffusers_sd[d] for d in m.diffusers], config) for m in maps}


def megatron_to_diffusers(name: str, tensor: torch.Tensor, config: FluxConfig) -> list[tuple[str, torch.Tensor]]:
    """One FULL megatron tensor (global name) -> its diffusers tensor(s); streaming-friendly."""
    m = _by_megatron(config).get(name)
    if m is None:
        raise ValueError(f"unknown megatron tensor {name!r} for this FLUX config")
    heads, width, ffn = config.num_attention_heads, config.hidden_size, config.ffn_hidden_size
    if m.kind == "qkv":
        return list(zip(m.diffusers, unfuse_qkv(tensor, heads)))
    if m.kind == "qkv_mlp":
        return list(zip(m.diffusers, split_heads(tensor, [width, width, width, ffn], heads)))
    if m.kind == "attn_mlp" and name.endswith(".weight"):
        return [(m.diffusers[0], torch.cat(split_heads(tensor, [width, ffn], heads, dim=1), dim=1))]
    return [(m.diffusers[0], tensor)]


def to_diffusers(megatron_full_sd: dict[str, torch.Tensor], config: FluxConfig) -> dict[str, torch.Tensor]:
    """Full megatron state dict (global names; ``_extra_state`` entries ignored) -> diffusers.

    ValueError names the first missing or unexpected megatron tensor."""
    names = {k for k in megatron_full_sd if not k.endswith("_extra_state")}
    maps = param_maps(config)
    missing = [m.megatron for m in maps if m.megatron not in names]
    if missing:
        raise ValueError(f"megatron tensor {missing[0]!r} is missing")
    unexpected = sorted(names - {m.megatron for m in maps})
    if unexpected:
        raise ValueError(f"unexpected megatron tensor {unexpected[0]!r}")
    out = {}
    for m in maps:
        out.update(megatron_to_diffusers(m.megatron, megatron_full_sd[m.megatron], config))
    return out


def to_megatron(diffusers_sd: dict[str, torch.Tensor], config: FluxConfig, *, tp_rank: int = 0,
                tp_size: int | None = None, pp_rank: int = 0, vp_stage: int | None = None) -> dict[str, torch.Tensor]:
    """The LOCAL megatron state dict of one rank: its TP shard of its stage's modules, block
    indices renumbered from 0 as in the stage's ``model.state_dict()``."""
    tp_size = tp_size or config.tensor_model_parallel_size
    full = to_megatron_full(diffusers_sd, config)
    return select_local(full, config, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, vp_stage=vp_stage)


def select_local(full: dict[str, torch.Tensor], config: FluxConfig, *, tp_rank: int, tp_size: int,
                 pp_rank: int = 0, vp_stage: int | None = None) -> dict[str, torch.Tensor]:
    """Slice a full global megatron state dict down to one rank's local state dict."""
    layers = stage_layers(config, pp_rank, vp_stage)
    vpp = config.virtual_pipeline_model_parallel_size
    first = pp_rank == 0 and (vp_stage or 0) == 0
    last = pp_rank == config.pipeline_model_parallel_size - 1 and (vp_stage is None or vp_stage == (vpp or 1) - 1)
    out = {}
    for m in param_maps(config):
        if m.layer is None:
            if (first if m.stage == "first" else last):
                out[m.megatron] = shard(full[m.megatron], m.split_dim, tp_rank, tp_size)
        elif m.layer in layers:
            local = m.megatron.replace(f"layers.{m.layer}.", f"layers.{m.layer - layers.start}.", 1)
            out[local] = shard(full[m.megatron], m.split_dim, tp_rank, tp_size)
    return out
