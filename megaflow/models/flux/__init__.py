"""FLUX.1 (dev / schnell) on megatron-core; ``FAMILY`` is what the registry hands out for "flux"."""
from megaflow.families.flux import CARD
from megaflow.models.flux import config, model, tiny, weight_map
from megaflow.models.flux.config import FluxConfig, from_diffusers
from megaflow.models.flux.model import FluxTransformer, model_inputs, pipeline_seq_length  # noqa: F401
from megaflow.models.flux.spec import get_flux_layer_spec
from megaflow.models.registry import ModelFamily

FAMILY = ModelFamily.from_modules(CARD.name, CARD.diffusers_class, config=config, model=model,
                                  weight_map=weight_map, layer_spec=get_flux_layer_spec, model_class=FluxTransformer,
                                  embedded_guidance=CARD.embedded_guidance, tiny=tiny)

__all__ = ["FAMILY", "FluxConfig", "FluxTransformer", "from_diffusers", "get_flux_layer_spec", "model_inputs",
           "weight_map"]
