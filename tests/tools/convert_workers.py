"""Rank functions for tests/tools: load a megatron dist checkpoint at some layout and run the
velocity forward. Module-level so they pickle by reference into the ranks."""
from __future__ import annotations

import megaflow  # noqa: F401  (import guards before megatron)
import torch


def load_and_velocity(ckpt: str, layout: dict, batch_path: str):
    """Build the layout, load ``ckpt`` (any layout it was saved at), return the velocity or None."""
    from megaflow.models.sd3 import from_diffusers
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed
    from megaflow.trainer.checkpoint import load_checkpoint, read_meta
    from megaflow.trainer.runner import Trainer

    dims = ParallelDims(**layout)
    init_distributed(dims)
    cfg = from_diffusers(read_meta(ckpt)["diffusers_config"], tensor_model_parallel_size=dims.tp,
                         pipeline_model_parallel_size=dims.pp, sequence_parallel=dims.sp)
    eng = Trainer(cfg, spec="local")
    load_checkpoint(eng.chunks, ckpt)
    b = torch.load(batch_path)
    v = eng.velocity(b["latents"], b["sigma"], b["encoder_hidden_states"], b["pooled_projections"])
    destroy_distributed()
    return v


def load_and_forward(ckpt: str, layout: dict, microbatch_path: str):
    """Build the layout for the checkpoint's recorded family, load ``ckpt``, run one trainer microbatch
    forward; the velocity on the last stage, else None."""
    from megaflow.models.registry import get_family
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed
    from megaflow.trainer.checkpoint import load_checkpoint, read_meta
    from megaflow.trainer.runner import Trainer

    dims = ParallelDims(**layout)
    init_distributed(dims)
    meta = read_meta(ckpt)
    cfg = get_family(meta["family"]).config_from_diffusers(
        meta["diffusers_config"], tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        sequence_parallel=dims.sp)
    eng = Trainer(cfg, family=meta["family"], spec="local")
    load_checkpoint(eng.chunks, ckpt)
    out = eng.forward_backward([torch.load(microbatch_path)], None, forward_only=True)
    destroy_distributed()
    return out[0] if out else None
