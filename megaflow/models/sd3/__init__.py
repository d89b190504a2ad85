"""SD3 / SD3.5 MMDiT on megatron-core: config mapping, layer spec, model, weight map.

``FAMILY`` is what ``megaflow.models.registry`` hands out for the name "sd3".
"""
from megaflow.models.registry import ModelFamily
from megaflow.models.sd3 import config, weight_map
from megaflow.models.sd3.config import MMDiTConfig, from_diffusers
from megaflow.models.sd3.model import SD3MMDiT, pipeline_seq_length
from megaflow.models.sd3.spec import get_mmdit_layer_spec

FAMILY = ModelFamily(
    name="sd3",
    diffusers_class="SD3Transformer2DModel",
    config_from_diffusers=config.from_diffusers,
    config_to_diffusers=config.to_diffusers,
    layer_spec=get_mmdit_layer_spec,
    model_class=SD3MMDiT,
    weight_map=weight_map,
    pipeline_seq_length=pipeline_seq_length,
)

__all__ = ["FAMILY", "MMDiTConfig", "SD3MMDiT", "from_diffusers", "get_mmdit_layer_spec", "weight_map"]
