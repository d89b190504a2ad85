"""The single SD3 name table: megatron name <-> diffusers name, TP split dim, fused-QKV recipe.

Trainer (loading diffusers weights), bridge (megatron -> engine names) and tools (checkpoint
conversion) all go through this module; nothing else spells parameter names.

Megatron names are GLOBAL here (``layers.<global block index>.``, as in dist checkpoints and
``iter_full_params``); ``to_megatron`` returns a rank's LOCAL state dict (local block indices,
this rank's TP shard, this stage's modules), ready for ``model.load_state_dict``.

Kinds (the TP plan; reasons in ``layers.py``):
    replicated  same tensor on every TP rank
    column      split on dim 0 (weight and bias)
    row         weight split on dim 1, bias replicated
    qkv         three diffusers tensors q, k, v [H, h] fused into one [3H, h] with rows
                interleaved per head ``[h0: q k v | h1: q k v | ...]``, then split on dim 0
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megaflow.models.sd3.config import MMDiTConfig

W, WB = ("weight",), ("weight", "bias")

# (megatron module, diffusers module(s), kind, param suffixes, when) -- top-level modules.
_TOP = (
    ("patch_embed.proj", "pos_embed.proj", "replicated", WB, "first"),
    ("patch_embed.pos_embed", "pos_embed.pos_embed", "replicated", ("",), "first"),  # a buffer
    ("time_embed.linear_1", "time_text_embed.timestep_embedder.linear_1", "replicated", WB, "first"),
    ("time_embed.linear_2", "time_text_embed.timestep_embedder.linear_2", "replicated", WB, "first"),
    ("text_embed.linear_1", "time_text_embed.text_embedder.linear_1", "replicated", WB, "first"),
    ("text_embed.linear_2", "time_text_embed.text_embedder.linear_2", "replicated", WB, "first"),
    ("context_embed", "context_embedder", "replicated", WB, "first"),
    ("final_adaln", "norm_out.linear", "replicated", WB, "last"),
    ("final_proj", "proj_out", "replicated", WB, "last"),
)
# Per block: "layers.{i}." <-> "transformer_blocks.{i}.". when: all | mid (not the last,
# context_pre_only block) | qk (qk_norm set) | dual (dual-attention block) | dual_qk.
_BLOCK = (
    ("adaln", "norm1.linear", "replicated", WB, "all"),
    ("context_adaln", "norm1_context.linear", "replicated", WB, "all"),
    ("attention.linear_qkv", ("attn.to_q", "attn.to_k", "attn.to_v"), "qkv", WB, "all"),
    ("attention.linear_proj", "attn.to_out.0", "row", WB, "all"),
    ("attention.context_linear_qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), "qkv", WB, "all"),
    ("attention.context_linear_proj", "attn.to_add_out", "row", WB, "mid"),
    ("attention.q_layernorm", "attn.norm_q", "replicated", W, "qk"),
    ("attention.k_layernorm", "attn.norm_k", "replicated", W, "qk"),
    ("attention.context_q_layernorm", "attn.norm_added_q", "replicated", W, "qk"),
    ("attention.context_k_layernorm", "attn.norm_added_k", "replicated", W, "qk"),
    ("attention2.linear_qkv", ("attn2.to_q", "attn2.to_k", "attn2.to_v"), "qkv", WB, "dual"),
    ("attention2.linear_proj", "attn2.to_out.0", "row", WB, "dual"),
    ("attention2.q_layernorm", "attn2.norm_q", "replicated", W, "dual_qk"),
    ("attention2.k_layernorm", "attn2.norm_k", "replicated", W, "dual_qk"),
    ("mlp.linear_fc1", "ff.net.0.proj", "column", WB, "all"),
    ("mlp.linear_fc2", "ff.net.2", "row", WB, "all"),
    ("context_mlp.linear_fc1", "ff_context.net.0.proj", "column", WB, "mid"),
    ("context_mlp.linear_fc2", "ff_context.net.2", "row", WB, "mid"),
)


@dataclass(frozen=True)
class ParamMap:
    """One megatron tensor and where it comes from."""

    megatron: str
    diffusers: tuple[str, ...]  # one name, or (q, k, v) for kind "qkv"
    kind: str
    layer: int | None  # global block index, None for top-level modules
    stage: str = "block"  # "first" / "last": top-level module of the first / last pipeline stage
    buffer: bool = False  # a persistent buffer (no grad), not a parameter

    @property
    def split_dim(self) -> int | None:
        """TP split dim of the megatron tensor (None = replicated)."""
        if self.kind in ("column", "qkv"):
            return 0
        if self.kind == "row" and self.megatron.endswith(".weight"):
            return 1
        return None


def _join(module: str, suffix: str) -> str:
    return f"{module}.{suffix}" if suffix else module


def _applies(when: str, config: MMDiTConfig, layer: int) -> bool:
    qk, dual = config.qk_norm is not None, layer in config.dual_attention_layers
    return {
        "all": True, "mid": layer != config.num_layers - 1, "qk": qk, "dual": dual, "dual_qk": dual and qk,
    }[when]


def param_maps(config: MMDiTConfig) -> list[ParamMap]:
    """Every megatron tensor of the full model (global names), in a stable order."""
    out = []
    top = [ParamMap(_join(mg, s), (_join(df, s),), kind, None, when, s == "")
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


def _by_megatron(config: MMDiTConfig) -> dict[str, ParamMap]:
    return {m.megatron: m for m in param_maps(config)}


def split_dim(config: MMDiTConfig, megatron_name: str) -> int | None:
    """TP split dim of a global megatron tensor name (ValueError for an unknown name)."""
    m = _by_megatron(config).get(megatron_name)
    if m is None:
        raise ValueError(f"unknown megatron tensor {megatron_name!r} for this SD3 config")
    return m.split_dim


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[H, ...] x3 -> [3H, ...] with rows interleaved per head (megatron's fused-QKV layout)."""
    if not q.shape == k.shape == v.shape:
        raise ValueError(f"q/k/v shapes differ: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    per_head = [t.reshape(num_heads, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.stack(per_head, dim=1).reshape(3 * q.shape[0], *q.shape[1:])


def unfuse_qkv(qkv: torch.Tensor, num_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv``."""
    per_head = qkv.reshape(num_heads, 3, -1, *qkv.shape[1:])
    return tuple(per_head[:, j].reshape(qkv.shape[0] // 3, *qkv.shape[1:]) for j in range(3))


def to_megatron_full(diffusers_sd: dict[str, torch.Tensor], config: MMDiTConfig) -> dict[str, torch.Tensor]:
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
    out = {}
    for m in maps:
        tensors = [diffusers_sd[d] for d in m.diffusers]
        out[m.megatron] = fuse_qkv(*tensors, config.num_attention_heads) if m.kind == "qkv" else tensors[0]
    return out


def megatron_to_diffusers(name: str, tensor: torch.Tensor, config: MMDiTConfig) -> list[tuple[str, torch.Tensor]]:
    """One FULL megatron tensor (global name) -> its diffusers tensor(s); streaming-friendly."""
    m = _by_megatron(config).get(name)
    if m is None:
        raise ValueError(f"unknown megatron tensor {name!r} for this SD3 config")
    if m.kind == "qkv":
        return list(zip(m.diffusers, unfuse_qkv(tensor, config.num_attention_heads)))
    return [(m.diffusers[0], tensor)]


def to_diffusers(megatron_full_sd: dict[str, torch.Tensor], config: MMDiTConfig) -> dict[str, torch.Tensor]:
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


def stage_layers(config: MMDiTConfig, pp_rank: int, vp_stage: int | None = None) -> range:
    """Global block indices held by pipeline rank ``pp_rank`` (virtual chunk ``vp_stage``)."""
    offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
    return range(offset, offset + get_num_layers_to_build(config, vp_stage, pp_rank))


def shard(full: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's contiguous slice of ``full`` along ``dim`` (the whole tensor if None)."""
    if dim is None or tp_size == 1:
        return full
    if full.shape[dim] % tp_size:
        raise ValueError(f"dim {dim} of size {full.shape[dim]} is not divisible by tp={tp_size}")
    return full.chunk(tp_size, dim=dim)[tp_rank]


def to_megatron(diffusers_sd: dict[str, torch.Tensor], config: MMDiTConfig, *, tp_rank: int = 0,
                tp_size: int | None = None, pp_rank: int = 0, vp_stage: int | None = None) -> dict[str, torch.Tensor]:
    """The LOCAL megatron state dict of one rank: its TP shard of its stage's modules, block
    indices renumbered from 0 as in the stage's ``model.state_dict()``."""
    tp_size = tp_size or config.tensor_model_parallel_size
    full = to_megatron_full(diffusers_sd, config)
    return select_local(full, config, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, vp_stage=vp_stage)


def select_local(full: dict[str, torch.Tensor], config: MMDiTConfig, *, tp_rank: int, tp_size: int,
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
