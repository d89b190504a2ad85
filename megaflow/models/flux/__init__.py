"""FLUX.1 (dev / schnell) on megatron-core: config mapping, layer spec, model, weight map.

``FAMILY`` is what ``megaflow.models.registry`` hands out for the name "flux".
"""
from megaflow.models.flux import config, weight_map
from megaflow.models.flux.config import FluxConfig, from_diffusers
from megaflow.models.flux.model import FluxTransformer, model_inputs, pipeline_seq_length
from megaflow.models.flux.spec import get_flux_layer_spec
from megaflow.models.registry import ModelFamily

FAMILY = ModelFamily(
    name="flux",
    diffusers_class="FluxTransformer2DModel",
    config_from_diffusers=config.from_diffusers,
    config_to_diffusers=config.to_diffusers,
    layer_spec=get_flux_layer_spec,
    model_class=FluxTransformer,
    weight_map=weight_map,
    pipeline_seq_length=pipeline_seq_length,
)

__all__ = ["FAMILY", "FluxConfig", "FluxTransformer", "from_diffusers", "get_flux_layer_spec", "model_inputs",
           "weight_map"]
