"""Wan 2.1 / 2.2 text-to-video transformer on megatron-core; ``FAMILY`` is what the registry hands out for "wan"."""
from megaflow.families.wan import CARD
from megaflow.models.registry import ModelFamily
from megaflow.models.wan import config, model, shapes, weight_map
from megaflow.models.wan.config import WanConfig, from_diffusers
from megaflow.models.wan.model import WanTransformer, model_inputs
from megaflow.models.wan.spec import get_wan_layer_spec

FAMILY = ModelFamily.from_modules(CARD.name, CARD.diffusers_class, config=config, model=model, weight_map=weight_map,
                                  layer_spec=get_wan_layer_spec, model_class=WanTransformer,
                                  embedded_guidance=CARD.embedded_guidance, shapes=shapes)

__all__ = ["FAMILY", "WanConfig", "WanTransformer", "from_diffusers", "get_wan_layer_spec", "model_inputs",
           "weight_map"]
