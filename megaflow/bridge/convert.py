"""Megatron names -> engine (diffusers) names: the convert stage of gather -> convert -> bucket -> push;
the family's weight map renames and splits fused tensors.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch


def engine_named_params(trainer) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's full weights under the engine's (diffusers) names, streamed (collective: every trainer
    rank must iterate it); a family whose engine fuses projections renames them (``ModelFamily.engine_tensors``)."""
    wm = trainer.family.weight_map
    named = (pair for name, tensor in trainer.iter_full_params()
             for pair in wm.megatron_to_diffusers(name, tensor, trainer.config))
    fuse = trainer.family.engine_tensors
    yield from (named if fuse is None else fuse(named))
