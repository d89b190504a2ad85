"""SD3 / SD3.5 MMDiT on megatron-core; ``FAMILY`` is what the registry hands out for "sd3"."""
from megaflow.families.sd3 import CARD
from megaflow.models.registry import ModelFamily
from megaflow.models.sd3 import config, model, shapes, tiny, weight_map
from megaflow.models.sd3.config import MMDiTConfig, from_diffusers
from megaflow.models.sd3.model import SD3MMDiT
from megaflow.models.sd3.spec import get_mmdit_layer_spec

FAMILY = ModelFamily.from_modules(CARD.name, CARD.diffusers_class, config=config, model=model, weight_map=weight_map,
                                  layer_spec=get_mmdit_layer_spec, model_class=SD3MMDiT,
                                  embedded_guidance=CARD.embedded_guidance, tiny=tiny, shapes=shapes)

__all__ = ["FAMILY", "MMDiTConfig", "SD3MMDiT", "from_diffusers", "get_mmdit_layer_spec", "weight_map"]
