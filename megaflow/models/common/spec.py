"""Layer-spec implementations shared by the families: WHICH classes build a block's parts.
``local``: megatron-core linears (runs anywhere, CPU + gloo), torch SDPA, torch RMSNorm; ``te``:
Transformer Engine; ``auto``: ``te`` when TE and CUDA are present, else ``local``.

Design notes: docs/design/models.md.
"""
from __future__ import annotations

import torch
from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from megaflow.models.common.layers import (
    AdaLNBlockSubmodules,
    HeadRMSNorm,
    JointAttentionSubmodules,
    LocalColumnParallelLinear,
    LocalRowParallelLinear,
    MMDiTMLP,
    ReplicatedLinear,
    SDPAttention,
)

IMPLS = ("auto", "local", "te")
__all__ = ["HAVE_TE", "IMPLS", "adaln_block_spec", "impl_classes", "resolve_impl"]


def resolve_impl(impl: str) -> str:
    """'auto' -> 'te' with Transformer Engine on CUDA, else 'local'; validates the name."""
    if impl not in IMPLS:
        raise ValueError(f"layer implementation {impl!r} is not one of {IMPLS}")
    if impl == "auto":
        return "te" if HAVE_TE and torch.cuda.is_available() else "local"
    if impl == "te" and not HAVE_TE:
        raise ValueError("layer implementation 'te' needs transformer_engine, which is not installed")
    return impl


def impl_classes(impl: str) -> dict[str, type]:
    """The classes of implementation ``impl`` ('auto' | 'local' | 'te', resolved by
    ``resolve_impl``): ``column`` / ``row`` parallel linears, ``core`` attention, q/k ``norm``."""
    if resolve_impl(impl) == "local":
        return dict(column=LocalColumnParallelLinear, row=LocalRowParallelLinear, core=SDPAttention, norm=HeadRMSNorm)
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear,
        TEDotProductAttention,
        TENorm,
        TERowParallelLinear,
    )

    return dict(column=TEColumnParallelLinear, row=TERowParallelLinear, core=TEDotProductAttention, norm=TENorm)


def adaln_block_spec(block: type, attention: type, classes: dict[str, type], *,
                     core_attention: type | None = None) -> ModuleSpec:
    """Spec of an adaLN-Zero double-stream block built from ``classes``; ``core_attention`` replaces the core attention."""
    attn = ModuleSpec(
        module=attention,
        submodules=JointAttentionSubmodules(
            linear_qkv=classes["column"],
            linear_proj=classes["row"],
            core_attention=core_attention or classes["core"],
            q_layernorm=classes["norm"],
            k_layernorm=classes["norm"],
        ),
    )
    mlp = ModuleSpec(module=MMDiTMLP, submodules=MLPSubmodules(linear_fc1=classes["column"],
                                                               linear_fc2=classes["row"]))
    return ModuleSpec(module=block, submodules=AdaLNBlockSubmodules(adaln=ReplicatedLinear, attention=attn, mlp=mlp))
