"""Build a family's megatron model from a spec name (``auto`` | ``local`` | ``te``) or a user
``"pkg.mod:fn"`` called as ``fn(config=, pp_rank=, vp_stage=)`` returning a block ``ModuleSpec`` or
a whole ``torch.nn.Module`` for this chunk. Design notes: docs/design/models.md.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from megatron.core import parallel_state
from megatron.core.transformer.spec_utils import ModuleSpec

from megaflow.config.dotted import resolve
from megaflow.models.registry import get_family

BUILTIN_SPECS = ("auto", "local", "te")


def load_callable(path: str) -> Callable[..., Any]:
    """The callable ``"pkg.mod:fn"`` names (attribute paths like ``"pkg.mod:Cls.make"`` allowed)."""
    obj = resolve(path, "model.spec")
    if not callable(obj):
        raise ValueError(f"model.spec {path!r} is not callable")
    return obj


def build_model(config, *, family: str = "sd3", spec: str = "auto", pp_rank: int | None = None,
                vp_stage: int | None = None) -> torch.nn.Module:
    """One pipeline chunk of ``family`` for ``config`` (megatron parallel_state must be set up)."""
    fam = get_family(family)
    if spec in BUILTIN_SPECS:
        layer_spec = fam.layer_spec(spec)
    else:
        built = load_callable(spec)(config=config, pp_rank=pp_rank, vp_stage=vp_stage)
        if isinstance(built, torch.nn.Module):
            return built
        if not isinstance(built, ModuleSpec):
            raise ValueError(f"{spec!r} returned {type(built).__name__}; expected a ModuleSpec or a torch.nn.Module")
        layer_spec = built
    return fam.model_class(config, layer_spec, pp_rank=pp_rank, vp_stage=vp_stage)


def build_model_chunks(config, *, family: str = "sd3", spec: str = "auto") -> list[torch.nn.Module]:
    """This rank's model chunks: one per virtual pipeline stage (one chunk without VPP)."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    vpp = config.virtual_pipeline_model_parallel_size
    stages = [None] if vpp is None else list(range(vpp))
    return [build_model(config, family=family, spec=spec, pp_rank=pp_rank, vp_stage=v) for v in stages]
