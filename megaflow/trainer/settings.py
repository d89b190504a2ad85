"""The mapping from megaflow's config to megatron's settings: TransformerConfig kwargs, optimizer, LoRA and the
learning-rate schedule. Each algorithm maps its own settings beside it (``run/<algorithm>.py``:
``grpo_settings``, ``nft_settings``)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megaflow.config.schema import MegaflowConfig


def transformer_kwargs(cfg: MegaflowConfig) -> dict:
    """Parallel layout and dtype kwargs for the family's ``config_from_diffusers``."""
    p = cfg.parallel
    kwargs = dict(tensor_model_parallel_size=p.tp, pipeline_model_parallel_size=p.pp, context_parallel_size=p.cp,
                  sequence_parallel=p.sp, virtual_pipeline_model_parallel_size=p.vpp or None)
    if cfg.model.dtype == "bfloat16":
        kwargs.update(bf16=True, params_dtype=torch.bfloat16)
    kwargs.update(recompute_kwargs(cfg))
    return kwargs


def recompute_kwargs(cfg: MegaflowConfig) -> dict:
    """``train.recompute`` / ``recompute_num_layers`` as megatron's recompute fields, which the DiT models
    read (megaflow.models.common.model.recompute_blocks): full + 0 -> every block its own checkpoint
    (uniform, 1 layer per unit); full + N -> the first N blocks of each chunk (block, N)."""
    t = cfg.train
    if t.recompute == "none":
        return {}
    if t.recompute_num_layers == 0:
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=t.recompute_num_layers)


def optimizer_config(cfg: MegaflowConfig):
    """megatron AdamW (ZeRO-1 distributed optimizer) from ``train``."""
    from megaflow.trainer.runner import adam_config
    t = cfg.train
    return adam_config(lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip, distributed=True,
                       bf16=cfg.model.dtype == "bfloat16")


def lora_settings(cfg: MegaflowConfig):
    """The trainer's LoRA settings from ``lora`` (None for full-parameter training, ``lora.rank`` 0); the
    adapters' A is drawn from ``run.seed``."""
    if cfg.lora.rank == 0:
        return None
    from megaflow.config.sections import from_section
    from megaflow.models.common.lora import LoRASettings
    return from_section(LoRASettings, cfg.lora, seed=cfg.run.seed)


def scheduled_lr(lr: float, step: int, *, warmup: int, total: int, schedule: str) -> float:
    """The learning rate at 0-based ``step`` of ``total``: linear warm-up over ``warmup`` steps (step k gets
    (k + 1) / warmup of ``lr``), then ``schedule``: "constant", or "cosine" from ``lr`` down to 0 at ``total``."""
    if schedule not in ("constant", "cosine"):
        raise ValueError(f"lr schedule must be 'constant' or 'cosine', got {schedule!r}")
    if schedule == "constant" or step < warmup:
        return lr * min(1.0, (step + 1) / max(1, warmup))
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate of every optimizer step of an iteration (``scheduled_lr`` by iteration): ``lr`` warmed
    up over ``warmup`` iterations, then ``schedule`` over ``total``. A function of the iteration alone, so a
    resumed run's iteration k has the uninterrupted run's lr."""

    lr: float
    warmup: int = 0
    total: int = 1
    schedule: str = "constant"

    def at(self, iteration: int) -> float:
        """The learning rate of (1-based) ``iteration``."""
        return scheduled_lr(self.lr, iteration - 1, warmup=self.warmup, total=self.total, schedule=self.schedule)


def lr_schedule(cfg: MegaflowConfig) -> LRSchedule:
    """The trainer's schedule from ``train`` (``lr``, ``warmup_iterations``, ``iterations``, ``lr_schedule``)."""
    t = cfg.train
    return LRSchedule(t.lr, warmup=t.warmup_iterations, total=t.iterations, schedule=t.lr_schedule)


def set_lr(optimizer, lr: float) -> None:
    """Set every param group of a (megatron) optimizer to ``lr``."""
    for group in optimizer.param_groups:
        group["lr"] = lr
