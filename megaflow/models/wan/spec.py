"""Layer spec for the Wan block: WHAT a block contains, separate from WHICH class builds it
(``megaflow.models.common.spec``); edit the returned spec to override any part. The q/k norms are always
``AcrossHeadsRMSNorm`` (a per-head norm such as TENorm would normalise each rank's heads alone).
"""
from __future__ import annotations

from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from megaflow.models.common.layers import JointAttentionSubmodules, MMDiTMLP
from megaflow.models.common.spec import impl_classes
from megaflow.models.wan.layers import (
    AcrossHeadsRMSNorm,
    CrossAttentionNorm,
    WanCrossAttention,
    WanLayer,
    WanLayerSubmodules,
    WanSelfAttention,
)


def get_wan_layer_spec(impl: str = "auto", *, core_attention: type | None = None) -> ModuleSpec:
    """The Wan block spec for ``impl`` ('auto' | 'local' | 'te'); optionally swap both attentions' core attention."""
    c = impl_classes(impl)

    def attention(module: type) -> ModuleSpec:
        return ModuleSpec(module=module, submodules=JointAttentionSubmodules(
            linear_qkv=c["column"], linear_proj=c["row"], core_attention=core_attention or c["core"],
            q_layernorm=AcrossHeadsRMSNorm, k_layernorm=AcrossHeadsRMSNorm))

    mlp = ModuleSpec(module=MMDiTMLP, submodules=MLPSubmodules(linear_fc1=c["column"], linear_fc2=c["row"]))
    return ModuleSpec(module=WanLayer, submodules=WanLayerSubmodules(
        self_attention=attention(WanSelfAttention), cross_attention=attention(WanCrossAttention),
        cross_norm=CrossAttentionNorm, mlp=mlp))
