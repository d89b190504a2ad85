"""Layer specs for the SD3 MMDiT block: WHAT a block contains, separate from WHICH class builds it.

- ``local``: megatron-core's own ColumnParallelLinear / RowParallelLinear (run anywhere, incl. CPU
  with gloo; subclassed only to fuse the bias into the GEMM when no TP comm is involved), torch
  SDPA for the core attention, a torch RMSNorm for q/k norms.
- ``te``: Transformer Engine linears, TE fused attention and TENorm (CUDA + transformer_engine).
- ``auto``: ``te`` when Transformer Engine and a CUDA device are present, else ``local``.

Any part can be overridden by editing the returned spec, or a whole spec/model can come from a
dotted path (``megaflow.models.provider``). megatron's local ``DotProductAttention`` fits the
``core_attention`` slot too (same interface), e.g. ``get_mmdit_layer_spec("local",
core_attention=DotProductAttention)``.
"""
from __future__ import annotations

import torch
from megatron.core.extensions.transformer_engine import HAVE_TE
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from megaflow.models.sd3.layers import (
    HeadRMSNorm,
    JointAttention,
    JointAttentionSubmodules,
    LocalColumnParallelLinear,
    LocalRowParallelLinear,
    MMDiTLayer,
    MMDiTLayerSubmodules,
    MMDiTMLP,
    ReplicatedLinear,
    SDPAttention,
)

IMPLS = ("auto", "local", "te")


def resolve_impl(impl: str) -> str:
    """'auto' -> 'te' with Transformer Engine on CUDA, else 'local'; validates the name."""
    if impl not in IMPLS:
        raise ValueError(f"layer implementation {impl!r} is not one of {IMPLS}")
    if impl == "auto":
        return "te" if HAVE_TE and torch.cuda.is_available() else "local"
    if impl == "te" and not HAVE_TE:
        raise ValueError("layer implementation 'te' needs transformer_engine, which is not installed")
    return impl


def _classes(impl: str) -> dict:
    if impl == "local":
        return dict(column=LocalColumnParallelLinear, row=LocalRowParallelLinear, core=SDPAttention, norm=HeadRMSNorm)
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear,
        TEDotProductAttention,
        TENorm,
        TERowParallelLinear,
    )

    return dict(column=TEColumnParallelLinear, row=TERowParallelLinear, core=TEDotProductAttention, norm=TENorm)


def get_mmdit_layer_spec(impl: str = "auto", *, core_attention: type | None = None) -> ModuleSpec:
    """The MMDiT block spec for ``impl`` ('auto' | 'local' | 'te'); optionally swap core attention."""
    c = _classes(resolve_impl(impl))
    attention = ModuleSpec(
        module=JointAttention,
        submodules=JointAttentionSubmodules(
            linear_qkv=c["column"],
            linear_proj=c["row"],
            core_attention=core_attention or c["core"],
            q_layernorm=c["norm"],
            k_layernorm=c["norm"],
        ),
    )
    mlp = ModuleSpec(module=MMDiTMLP, submodules=MLPSubmodules(linear_fc1=c["column"], linear_fc2=c["row"]))
    return ModuleSpec(
        module=MMDiTLayer,
        submodules=MMDiTLayerSubmodules(adaln=ReplicatedLinear, attention=attention, mlp=mlp),
    )
