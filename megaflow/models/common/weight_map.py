"""The generic weight map: diffusers <-> megatron state dicts over one family's name table.
Design notes: docs/design/models.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from megaflow.models.common.model import stage_ends, stage_layers

__all__ = [
    "ADALN_ATTENTION_ROWS", "ADALN_MLP_ROWS", "FINAL_ROWS", "QKV", "W", "WB", "ParamMap", "Recipe", "WeightMap",
    "block_maps", "embed_mlp_rows", "fuse_qkv", "interleave_heads", "join", "shard", "split_heads", "stage_layers",
    "unfuse_qkv",
]

W, WB = ("weight",), ("weight", "bias")  # param suffixes of a norm / of a biased linear

FINAL_ROWS = (
    ("final_adaln", "norm_out.linear", "replicated", WB, "last"),
    ("final_proj", "proj_out", "replicated", WB, "last"),
)
# Block rows, relative to "layers.{i}." / the diffusers block prefix. when: all | context_out (not
# in a block whose context stream is only attended to: SD3's context_pre_only last block) | qk
# (q/k RMSNorm configured).
ADALN_ATTENTION_ROWS = (
    ("adaln", "norm1.linear", "replicated", WB, "all"),
    ("context_adaln", "norm1_context.linear", "replicated", WB, "all"),
    ("attention.linear_qkv", ("attn.to_q", "attn.to_k", "attn.to_v"), "qkv", WB, "all"),
    ("attention.linear_proj", "attn.to_out.0", "row", WB, "all"),
    ("attention.context_linear_qkv", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"), "qkv", WB, "all"),
    ("attention.context_linear_proj", "attn.to_add_out", "row", WB, "context_out"),
    ("attention.q_layernorm", "attn.norm_q", "replicated", W, "qk"),
    ("attention.k_layernorm", "attn.norm_k", "replicated", W, "qk"),
    ("attention.context_q_layernorm", "attn.norm_added_q", "replicated", W, "qk"),
    ("attention.context_k_layernorm", "attn.norm_added_k", "replicated", W, "qk"),
)
ADALN_MLP_ROWS = (
    ("mlp.linear_fc1", "ff.net.0.proj", "column", WB, "all"),
    ("mlp.linear_fc2", "ff.net.2", "row", WB, "all"),
    ("context_mlp.linear_fc1", "ff_context.net.0.proj", "column", WB, "context_out"),
    ("context_mlp.linear_fc2", "ff_context.net.2", "row", WB, "context_out"),
)


def embed_mlp_rows(megatron: str, diffusers: str, when: str) -> tuple[tuple, ...]:
    """Rows of an ``EmbedMLP`` (diffusers' ``TimestepEmbedding`` / text projection): linear_1, linear_2."""
    return tuple((f"{megatron}.linear_{i}", f"{diffusers}.linear_{i}", "replicated", WB, when) for i in (1, 2))


@dataclass(frozen=True)
class ParamMap:
    """One megatron tensor and where it comes from."""

    megatron: str
    diffusers: tuple[str, ...]  # one name, or the fused parts (e.g. (q, k, v) for kind "qkv")
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


def block_maps(rows, megatron_prefix: str, diffusers_prefix: str, layer: int,
               param_map: type = ParamMap) -> list[ParamMap]:
    """Every row of a block table (all its parts present) as ``param_map``s of global block ``layer``."""
    out = []
    for mg, df, kind, suffixes, _when in rows:
        dfs = df if isinstance(df, tuple) else (df,)
        out += [param_map(f"{megatron_prefix}{mg}.{s}", tuple(f"{diffusers_prefix}{d}.{s}" for d in dfs), kind, layer)
                for s in suffixes]
    return out


def join(module: str, suffix: str) -> str:
    """``module.suffix`` (just ``module`` for the empty suffix of a buffer)."""
    return f"{module}.{suffix}" if suffix else module


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


def shard(full: torch.Tensor, dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's contiguous slice of ``full`` along ``dim`` (the whole tensor if None)."""
    if dim is None or tp_size == 1:
        return full
    if full.shape[dim] % tp_size:
        raise ValueError(f"dim {dim} of size {full.shape[dim]} is not divisible by tp={tp_size}")
    return full.chunk(tp_size, dim=dim)[tp_rank]


@dataclass(frozen=True)
class Recipe:
    """A fused kind: ``fuse(m, tensors, config)`` diffusers tensors (``m.diffusers`` order) -> FULL
    megatron tensor; ``unfuse`` its inverse."""

    fuse: Callable[[ParamMap, list[torch.Tensor], Any], torch.Tensor]
    unfuse: Callable[[ParamMap, torch.Tensor, Any], list[torch.Tensor]]


def _fuse_qkv_recipe(m: ParamMap, tensors: list[torch.Tensor], config) -> torch.Tensor:
    return fuse_qkv(*tensors, config.num_attention_heads)


def _unfuse_qkv_recipe(m: ParamMap, tensor: torch.Tensor, config) -> list[torch.Tensor]:
    return list(unfuse_qkv(tensor, config.num_attention_heads))


QKV = Recipe(fuse=_fuse_qkv_recipe, unfuse=_unfuse_qkv_recipe)
"""Recipe of kind "qkv" (``fuse_qkv`` / ``unfuse_qkv`` with the config's head count)."""


class WeightMap:
    """The conversions over one family's table: ``param_maps(config)`` (every megatron tensor, global
    names, stable order), ``recipes`` per fused kind, ``family`` for error messages."""

    def __init__(self, family: str, param_maps: Callable[[Any], list[ParamMap]], recipes: dict[str, Recipe]):
        self.family, self.param_maps, self.recipes = family, param_maps, dict(recipes)
        self._table: tuple[Any, dict[str, ParamMap]] | None = None

    def _lookup(self, config, megatron_name: str) -> ParamMap:
        if self._table is None or self._table[0] is not config:  # one table per config object (a streamed sync
            self._table = (config, {m.megatron: m for m in self.param_maps(config)})  # looks up every tensor)
        m = self._table[1].get(megatron_name)
        if m is None:
            raise ValueError(f"unknown megatron tensor {megatron_name!r} for this {self.family} config")
        return m

    def split_dim(self, config, megatron_name: str) -> int | None:
        """TP split dim of a global megatron tensor name (ValueError for an unknown name)."""
        return self._lookup(config, megatron_name).split_dim

    def _fuse(self, m: ParamMap, tensors: list[torch.Tensor], config) -> torch.Tensor:
        recipe = self.recipes.get(m.kind)
        return tensors[0] if recipe is None else recipe.fuse(m, tensors, config)

    def to_megatron_full(self, diffusers_sd: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
        """Full megatron state dict (global names) from diffusers; ValueError names the first missing or unexpected tensor."""
        maps = self.param_maps(config)
        expected = {d for m in maps for d in m.diffusers}
        missing = [d for m in maps for d in m.diffusers if d not in diffusers_sd]
        if missing:
            raise ValueError(f"diffusers tensor {missing[0]!r} is missing (config does not match the weights)")
        unexpected = [k for k in diffusers_sd if k not in expected]
        if unexpected:
            raise ValueError(f"unexpected diffusers tensor {unexpected[0]!r} (config does not match the weights)")
        return {m.megatron: self._fuse(m, [diffusers_sd[d] for d in m.diffusers], config) for m in maps}

    def megatron_to_diffusers(self, name: str, tensor: torch.Tensor, config) -> list[tuple[str, torch.Tensor]]:
        """One FULL megatron tensor (global name) -> its diffusers tensor(s); streaming-friendly."""
        m = self._lookup(config, name)
        recipe = self.recipes.get(m.kind)
        if recipe is None:
            return [(m.diffusers[0], tensor)]
        return list(zip(m.diffusers, recipe.unfuse(m, tensor, config)))

    def to_diffusers(self, megatron_full_sd: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
        """Full megatron state dict (``_extra_state`` ignored) -> diffusers; ValueError names the first missing or unexpected tensor."""
        names = {k for k in megatron_full_sd if not k.endswith("_extra_state")}
        maps = self.param_maps(config)
        missing = [m.megatron for m in maps if m.megatron not in names]
        if missing:
            raise ValueError(f"megatron tensor {missing[0]!r} is missing")
        unexpected = sorted(names - {m.megatron for m in maps})
        if unexpected:
            raise ValueError(f"unexpected megatron tensor {unexpected[0]!r}")
        out = {}
        for m in maps:
            out.update(self.megatron_to_diffusers(m.megatron, megatron_full_sd[m.megatron], config))
        return out

    def to_megatron(self, diffusers_sd: dict[str, torch.Tensor], config, *, tp_rank: int = 0,
                    tp_size: int | None = None, pp_rank: int = 0, vp_stage: int | None = None) -> dict[str, torch.Tensor]:
        """The LOCAL megatron state dict of one rank: its TP shard of its stage's modules, block
        indices renumbered from 0 as in the stage's ``model.state_dict()``."""
        tp_size = tp_size or config.tensor_model_parallel_size
        full = self.to_megatron_full(diffusers_sd, config)
        return self.select_local(full, config, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, vp_stage=vp_stage)

    def select_local(self, full: dict[str, torch.Tensor], config, *, tp_rank: int, tp_size: int,
                     pp_rank: int = 0, vp_stage: int | None = None) -> dict[str, torch.Tensor]:
        """Slice a full global megatron state dict down to one rank's local state dict."""
        layers = stage_layers(config, pp_rank, vp_stage)
        first, last = stage_ends(config, pp_rank, vp_stage)
        out = {}
        for m in self.param_maps(config):
            if m.layer is None:
                if (first if m.stage == "first" else last):
                    out[m.megatron] = shard(full[m.megatron], m.split_dim, tp_rank, tp_size)
            elif m.layer in layers:
                local = m.megatron.replace(f"layers.{m.layer}.", f"layers.{m.layer - layers.start}.", 1)
                out[local] = shard(full[m.megatron], m.split_dim, tp_rank, tp_size)
        return out
