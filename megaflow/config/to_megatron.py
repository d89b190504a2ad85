"""The ONE mapping from megaflow's config to megatron-core settings (TransformerConfig kwargs, optimizer)."""
from __future__ import annotations

import torch

from megaflow.config.schema import MegaflowConfig


def transformer_kwargs(cfg: MegaflowConfig) -> dict:
    """Parallel layout and dtype kwargs for the family's ``config_from_diffusers``."""
    p = cfg.parallel
    kwargs = dict(tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp, context_parallel_size=p.cp,
                  sequence_parallel=p.sp, virtual_pipeline_model_parallel_size=p.vpp or None)
    if cfg.model.dtype == "bfloat16":
        kwargs.update(bf16=True, params_dtype=torch.bfloat16)
    return kwargs


def optimizer_config(cfg: MegaflowConfig):
    """megatron AdamW (ZeRO-1 distributed optimizer) from ``train``."""
    from megaflow.trainer.engine import adam_config
    t = cfg.train
    return adam_config(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip, distributed=True,
                       bf16=cfg.model.dtype == "bfloat16")
