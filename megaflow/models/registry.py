"""Model families by name: the torch part (``ModelFamily``) of each family registered in ``megaflow.families``
(one line there per family; its card names the package defining ``FAMILY``), no dispatch on substrings of model
ids. A family bundles the diffusers class, config mapping, layer spec, model class and weight map; imported on
first use, and its name, diffusers class and guidance agree with its card.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType
from collections.abc import Iterable, Iterator
from typing import Any, Callable

from megaflow.families import card, family_names



@dataclass(frozen=True, kw_only=True)
class ModelFamily:
    """Everything family-specific, as plain callables and modules."""

    name: str
    diffusers_class: str
    """Class name in the diffusers ``transformer/config.json`` (``_class_name``)."""
    config_from_diffusers: Callable[..., Any]
    """(diffusers config dict | path, **megatron_kwargs) -> megatron TransformerConfig subclass."""
    config_to_diffusers: Callable[[Any], dict]
    """megatron config -> diffusers config dict (for writing config.json)."""
    layer_spec: Callable[..., Any]
    """(impl: 'auto' | 'local' | 'te') -> megatron ModuleSpec of one block."""
    model_class: type
    """model_class(config, layer_spec, pp_rank=, vp_stage=) -> one pipeline chunk."""
    weight_map: ModuleType
    """Module with param_maps / to_megatron / to_diffusers / megatron_to_diffusers / split_dim."""
    pipeline_seq_length: Callable[..., int]
    """(config, num_image_tokens, num_context_tokens) -> seq_length for megatron's schedule."""
    model_inputs: Callable[[Any, dict], dict]
    """(config, trainer microbatch) -> the model's forward kwargs."""
    microbatch_seq_length: Callable[[Any, dict], int]
    """(config, trainer microbatch) -> seq_length for megatron's schedule."""
    batch_conditioning: Callable[[Any, Any, bool], dict]
    """(config, the trajectories of one trainer microbatch, cfg) -> its conditioning keys: what
    ``model_inputs`` reads besides latents and sigma, batched ([negative; positive] under CFG)."""
    tiny: ModuleType | None = None
    """Module with the family's tiny configs and reference models (``tiny_config``, ``diffusers_model``, ...) and
    the GPU check's microbatch layout (``check_latent_shape``, ``check_inputs``); None: the family has none."""
    embedded_guidance: bool = False
    """True: a rollout's ``guidance_scale`` is a model input (FLUX.1-dev's guidance embedding) and never
    turns on classifier-free guidance; False: guidance_scale > 1 samples with CFG (two branches)."""
    shapes: ModuleType | None = None
    """Module building the family's ShapeEval pipeline for ``megaflow pretrain`` (the contract:
    ``megaflow.pretrain.kit``); None: the family cannot be pretrained on ShapeEval."""
    engine_tensors: Callable[[Iterable[tuple[str, Any]]], Iterator[tuple[str, Any]]] | None = None
    """(diffusers-named full tensors, in the weight map's order) -> the same weights under the names of SGLang's
    native DiT where it fuses projections (Qwen-Image's ``to_added_qkv``), so an update is loaded and checked by
    name; None: the engine holds the diffusers names (the weight map module's ``engine_tensors``, if any)."""

    @classmethod
    def from_modules(cls, name: str, diffusers_class: str, *, config: ModuleType, model: ModuleType,
                     weight_map: ModuleType, layer_spec: Callable[..., Any], model_class: type,
                     embedded_guidance: bool = False, tiny: ModuleType | None = None,
                     shapes: ModuleType | None = None) -> ModelFamily:
        """The family of a package laid out like ``megaflow.models.sd3`` (``config`` and ``model`` modules)."""
        return cls(name=name, diffusers_class=diffusers_class, config_from_diffusers=config.from_diffusers,
                   config_to_diffusers=config.to_diffusers, layer_spec=layer_spec, model_class=model_class,
                   weight_map=weight_map, pipeline_seq_length=model.pipeline_seq_length,
                   model_inputs=model.model_inputs, microbatch_seq_length=model.microbatch_seq_length,
                   batch_conditioning=model.batch_conditioning, embedded_guidance=embedded_guidance, tiny=tiny,
                   shapes=shapes,
                   engine_tensors=getattr(weight_map, "engine_tensors", None))


def get_family(name: str) -> ModelFamily:
    """The family registered as ``name`` (its card's ``package``); ValueError naming it if unknown."""
    return importlib.import_module(card(name).package).FAMILY


__all__ = ["ModelFamily", "card", "family_names", "get_family"]
