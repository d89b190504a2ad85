"""Layer spec for the Qwen-Image block: WHAT a block contains (the shared RoPE double-stream block with
Qwen-Image's masked joint attention), separate from WHICH class builds it (``megaflow.models.common.spec``).
"""
from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from megaflow.models.common.rope import RopeDoubleLayer
from megaflow.models.common.spec import adaln_block_spec, impl_classes
from megaflow.models.qwen_image.layers import QwenJointAttention


def get_qwen_image_layer_spec(impl: str = "auto", *, core_attention: type | None = None) -> ModuleSpec:
    """The Qwen-Image block spec for ``impl`` ('auto' | 'local' | 'te'); optionally swap core attention
    (it is built for a padding mask: ``AttnMaskType.padding``)."""
    return adaln_block_spec(RopeDoubleLayer, QwenJointAttention, impl_classes(impl), core_attention=core_attention)
