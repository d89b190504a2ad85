"""LoRA adapters on the megatron DiT's parallel linears: y = base(x) + (alpha / rank) * B A x,
base frozen. Adapted: every ``qkv`` / ``column`` / ``row`` linear whose leaf (``context_`` dropped)
is in ``LoRASettings.targets``.

Design notes: docs/design/models.md.
"""
from __future__ import annotations

import math
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

from megaflow.models.common.weight_map import shard

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
KINDS = ("qkv", "column", "row")


@dataclass(frozen=True, kw_only=True)
class LoRASettings:
    """rank r, alpha (scale alpha / r), target module leaves (``TARGETS``), seed of A's init."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = TARGETS
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be an int >= 1, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha!r}")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise ValueError(f"LoRA targets {list(self.targets)}: each must be one of {TARGETS}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def target_leaf(megatron_module: str) -> str:
    """``layers.3.attention.context_linear_qkv`` -> ``linear_qkv`` (the target name of a module)."""
    return megatron_module.rsplit(".", 1)[-1].removeprefix("context_")


class LoRAAdapter(torch.nn.Module):
    """The adapter of one parallel linear (see the module's design notes): ``forward(x)`` is the term added
    to the base output, ``enabled=False`` makes the hook skip it."""

    def __init__(self, kind: str, a_full: torch.Tensor, b_shape: tuple[int, int], *, scale: float, config):
        super().__init__()
        assert kind in KINDS, kind
        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        self.kind, self.scale, self.enabled, self.config = kind, scale, True, config
        self.sequence_parallel = config.sequence_parallel and tp > 1
        self.tp = tp
        a = shard(a_full, 1 if kind == "row" else None, rank, tp)
        self.a = torch.nn.Parameter(a.to(config.params_dtype).contiguous())
        self.b = torch.nn.Parameter(torch.zeros(b_shape, dtype=config.params_dtype, device=a.device))
        self.a.lora_split_dim = 1 if kind == "row" else None  # read by DiTModel.sharded_state_dict
        self.b.lora_split_dim = None if kind == "row" else 0
        # grads that are partial sums over sequence shards (summed over TP by finalize_model_grads)
        self.a.sequence_parallel = self.sequence_parallel and kind != "row"
        self.b.sequence_parallel = self.sequence_parallel and kind == "row"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.a)
        if self.kind == "row":
            if self.sequence_parallel:
                h = reduce_scatter_to_sequence_parallel_region(h)
            elif self.tp > 1:
                h = reduce_from_tensor_model_parallel_region(h)
            return self.scale * F.linear(h, self.b)
        if self.sequence_parallel:
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True)
        elif self.tp > 1:
            h = copy_to_tensor_model_parallel_region(h)
        if self.kind == "column":
            return self.scale * F.linear(h, self.b)
        s, b, _ = h.shape  # qkv: part j of the hidden feeds the j-th third of every head's rows
        head_dim = self.config.kv_channels
        bv = self.b.view(-1, 3, head_dim, self.b.shape[-1])
        out = torch.einsum("sbjr,hjdr->sbhjd", h.view(s, b, 3, -1), bv)
        return self.scale * out.reshape(s, b, -1)


def _apply_adapter(module, args, output):
    adapter = module.lora
    if not adapter.enabled:
        return output
    out, bias = output
    return out + adapter(args[0]).to(out.dtype), bias


def init_a(name: str, kind: str, rank: int, in_features: int, seed: int) -> torch.Tensor:
    """The FULL A of adapter ``name`` (PEFT's kaiming-uniform(a=sqrt(5)), fan_in = in_features), from a
    generator seeded by ``seed`` and the name: the same tensor at every parallel layout."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    rows = 3 * rank if kind == "qkv" else rank
    bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) * sqrt(3 / fan_in)
    return (torch.rand(rows, in_features, generator=g) * 2 - 1) * bound


def adapted_modules(weight_map, config, targets) -> list[tuple[str, object]]:
    """(global megatron module, its weight's ParamMap) of every adapted linear of the full model."""
    out = []
    for m in weight_map.param_maps(config):
        module, _, suffix = m.megatron.rpartition(".")
        if suffix == "weight" and m.kind in KINDS and target_leaf(module) in targets:
            out.append((module, m))
    return out


def attach_lora(chunk: torch.nn.Module, weight_map, settings: LoRASettings) -> int:
    """Freeze every parameter of ``chunk`` (one pipeline chunk, unwrapped) and attach an adapter to each
    of its targeted linears; returns how many. ValueError if the model has none of the targets."""
    config = chunk.config
    chunk.requires_grad_(False)
    start = chunk.global_layer_numbers[0] if len(chunk.layers) else 0
    held = set(chunk.global_layer_numbers)
    count = 0
    for module_name, m in adapted_modules(weight_map, config, settings.targets):
        kind, layer = m.kind, m.layer
        if layer not in held:
            continue
        local = module_name.replace(f"layers.{layer}.", f"layers.{layer - start}.", 1)
        linear = chunk.get_submodule(local)
        out_local, in_local = linear.weight.shape
        in_full = in_local * ps.get_tensor_model_parallel_world_size() if kind == "row" else in_local
        a_full = init_a(module_name, kind, settings.rank, in_full, settings.seed).to(linear.weight.device)
        linear.lora = LoRAAdapter(kind, a_full, (out_local, settings.rank), scale=settings.scale, config=config)
        linear.register_forward_hook(_apply_adapter)
        count += 1
    if count == 0 and held:
        raise ValueError(f"LoRA targets {list(settings.targets)} match no linear of this model")
    return count


def adapters(chunks) -> Iterator[LoRAAdapter]:
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, LoRAAdapter):
                yield module


@contextmanager
def adapters_disabled(chunks):
    """Within the block the chunks compute the base model (every adapter skipped)."""
    found = list(adapters(chunks))
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a in found:
            a.enabled = True


def adapter_state(chunk: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The chunk's adapter tensors under their local state-dict names (``....lora.a`` / ``....lora.b``)."""
    return {k: v for k, v in chunk.state_dict().items() if k.endswith((".lora.a", ".lora.b"))}
