"""Qwen-Image on megatron-core; ``FAMILY`` is what the registry hands out for "qwen_image"."""
from megaflow.families.qwen_image import CARD
from megaflow.models.qwen_image import config, model, shapes, tiny, weight_map
from megaflow.models.qwen_image.config import QwenImageConfig, from_diffusers
from megaflow.models.qwen_image.model import QwenImageTransformer, model_inputs
from megaflow.models.qwen_image.spec import get_qwen_image_layer_spec
from megaflow.models.registry import ModelFamily

FAMILY = ModelFamily.from_modules(CARD.name, CARD.diffusers_class, config=config, model=model,
                                  weight_map=weight_map, layer_spec=get_qwen_image_layer_spec,
                                  model_class=QwenImageTransformer, embedded_guidance=CARD.embedded_guidance,
                                  tiny=tiny, shapes=shapes)

__all__ = ["FAMILY", "QwenImageConfig", "QwenImageTransformer", "from_diffusers", "get_qwen_image_layer_spec",
           "model_inputs", "weight_map"]
