"""Layer spec for FLUX.1: WHAT each block kind contains, separate from WHICH class builds it.

FLUX has two block kinds, so its spec is one ``ModuleSpec`` of the block stack (``module`` =
``FluxTransformer``) whose submodules hold one spec per kind (``double`` and ``single``) -- the
one difference from SD3's single-block spec, and what a user provider (``"pkg.mod:fn"``) must
return too. Implementations (``local`` / ``te`` / ``auto``) are resolved exactly as for SD3
(``megaflow.models.sd3.spec.resolve_impl``); ``core_attention`` swaps the core attention of both
kinds (e.g. megatron's ``DotProductAttention``).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from megaflow.models.flux.layers import (
    FluxDoubleLayer,
    FluxDoubleLayerSubmodules,
    FluxJointAttention,
    FluxSingleLayer,
    FluxSingleLayerSubmodules,
)
from megaflow.models.sd3.layers import JointAttentionSubmodules, MMDiTMLP, ReplicatedLinear
from megaflow.models.sd3.spec import _classes, resolve_impl


@dataclass
class FluxBlockSpecs:
    """One spec per FLUX block kind."""

    double: ModuleSpec
    single: ModuleSpec


def get_flux_layer_spec(impl: str = "auto", *, core_attention: type | None = None) -> ModuleSpec:
    """The FLUX block-stack spec for ``impl`` ('auto' | 'local' | 'te'); optionally swap core attention."""
    from megaflow.models.flux.model import FluxTransformer

    c = _classes(resolve_impl(impl))
    core = core_attention or c["core"]
    attention = ModuleSpec(
        module=FluxJointAttention,
        submodules=JointAttentionSubmodules(linear_qkv=c["column"], linear_proj=c["row"], core_attention=core,
                                            q_layernorm=c["norm"], k_layernorm=c["norm"]),
    )
    mlp = ModuleSpec(module=MMDiTMLP, submodules=MLPSubmodules(linear_fc1=c["column"], linear_fc2=c["row"]))
    double = ModuleSpec(module=FluxDoubleLayer,
                        submodules=FluxDoubleLayerSubmodules(adaln=ReplicatedLinear, attention=attention, mlp=mlp))
    single = ModuleSpec(
        module=FluxSingleLayer,
        submodules=FluxSingleLayerSubmodules(adaln=ReplicatedLinear, linear_qkv_mlp=c["column"],
                                             linear_proj=c["row"], core_attention=core,
                                             q_layernorm=c["norm"], k_layernorm=c["norm"]),
    )
    return ModuleSpec(module=FluxTransformer, submodules=FluxBlockSpecs(double=double, single=single))
