"""Layer spec for the SD3 MMDiT block: WHAT a block contains, separate from WHICH class builds it
(``megaflow.models.common.spec``); edit the returned spec to override any part.
"""
from __future__ import annotations

from megatron.core.transformer.spec_utils import ModuleSpec

from megaflow.models.common.layers import JointAttention
from megaflow.models.common.spec import adaln_block_spec, impl_classes
from megaflow.models.sd3.layers import MMDiTLayer


def get_mmdit_layer_spec(impl: str = "auto", *, core_attention: type | None = None) -> ModuleSpec:
    """The MMDiT block spec for ``impl`` ('auto' | 'local' | 'te'); optionally swap core attention."""
    return adaln_block_spec(MMDiTLayer, JointAttention, impl_classes(impl), core_attention=core_attention)
