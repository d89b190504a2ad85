"""LoRA adapter tensors <-> diffusers/PEFT names, over the family's own weight map:
``<module>.lora.a`` / ``.lora.b`` <-> ``<diffusers module>.lora_A.weight`` / ``.lora_B.weight``.

Design notes: docs/design/models.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megaflow.models.common.lora import LoRASettings, adapted_modules
from megaflow.models.common.weight_map import QKV, ParamMap, Recipe, WeightMap, stage_layers


@dataclass(frozen=True)
class AdapterMap(ParamMap):
    """A ParamMap whose TP split dim is given (``dim``) rather than derived from a base kind."""

    dim: int | None = None

    @property
    def split_dim(self) -> int | None:
        return self.dim


def _cat3(m, tensors, config) -> torch.Tensor:
    return torch.cat(tensors, dim=0)


def _split3(m, tensor, config) -> list[torch.Tensor]:
    return list(tensor.chunk(3, dim=0))


RECIPES = {"lora_a_qkv": Recipe(fuse=_cat3, unfuse=_split3), "lora_b_qkv": QKV}


def adapter_param_maps(family_weight_map, config, targets) -> list[AdapterMap]:
    """The adapter tensors of the full model (global names), in the base table's order."""
    out = []
    for module, m in adapted_modules(family_weight_map, config, targets):
        bases = [d.removesuffix(".weight") for d in m.diffusers]
        qkv, row = m.kind == "qkv", m.kind == "row"
        out.append(AdapterMap(f"{module}.lora.a", tuple(f"{d}.lora_A.weight" for d in bases),
                              "lora_a_qkv" if qkv else "lora_a", m.layer, dim=1 if row else None))
        out.append(AdapterMap(f"{module}.lora.b", tuple(f"{d}.lora_B.weight" for d in bases),
                              "lora_b_qkv" if qkv else "lora_b", m.layer, dim=None if row else 0))
    return out


def lora_weight_map(family_weight_map, settings: LoRASettings) -> WeightMap:
    """The ``WeightMap`` of the adapters ``settings`` attaches to a model of ``family_weight_map``."""
    wm = WeightMap(f"{family_weight_map.WEIGHTS.family} LoRA",
                   lambda config: adapter_param_maps(family_weight_map, config, settings.targets), RECIPES)
    wm.stage_layers = stage_layers  # read by the full-tensor gather's owner table
    return wm
