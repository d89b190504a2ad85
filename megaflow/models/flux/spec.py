"""Layer spec for FLUX.1: WHAT each block kind contains, separate from WHICH class builds it.
One ``ModuleSpec`` of the block stack holding a spec per kind (``double``, ``single``) -- also what a
user provider must return; ``core_attention`` swaps both kinds' core attention.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron.core.transformer.spec_utils import ModuleSpec

from megaflow.models.common.layers import ReplicatedLinear
from megaflow.models.common.spec import adaln_block_spec, impl_classes
from megaflow.models.flux.layers import (
    FluxDoubleLayer,
    FluxJointAttention,
    FluxSingleLayer,
    FluxSingleLayerSubmodules,
)


@dataclass
class FluxBlockSpecs:
    """One spec per FLUX block kind."""

    double: ModuleSpec
    single: ModuleSpec


def get_flux_layer_spec(impl: str = "auto", *, core_attention: type | None = None) -> ModuleSpec:
    """The FLUX block-stack spec for ``impl`` ('auto' | 'local' | 'te'); optionally swap core attention."""
    from megaflow.models.flux.model import FluxTransformer

    c = impl_classes(impl)
    double = adaln_block_spec(FluxDoubleLayer, FluxJointAttention, c, core_attention=core_attention)
    single = ModuleSpec(
        module=FluxSingleLayer,
        submodules=FluxSingleLayerSubmodules(adaln=ReplicatedLinear, linear_qkv_mlp=c["column"],
                                             linear_proj=c["row"], core_attention=core_attention or c["core"],
                                             q_layernorm=c["norm"], k_layernorm=c["norm"]),
    )
    return ModuleSpec(module=FluxTransformer, submodules=FluxBlockSpecs(double=double, single=single))
