"""DiffusionNFT in the megatron trainer: clean samples -> noised items (``plan_items``) -> optimizer steps of
megaflow.algo.nft's loss; v_old and v_ref computed forward-only before the first update.

Invariant: timestep draws, shuffle and every ε come from the caller's generator before any DP split, so every
layout trains on the same items and noise. Details: docs/algorithms/nft.md.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Sequence

import torch
from megatron.core import parallel_state as ps

from megaflow.algo.nft import NFTConfig, nft_loss
from megaflow.parallel.distributed import current_device
from megaflow.rollout.types import Trajectory
from megaflow.trainer.batch import (CleanItem as Item, aggregate_stats, attach_velocities, batch_conditioning,
                                    check_counts, clean_microbatches, combine_steps, share_from_last_stage)


@dataclass(frozen=True, kw_only=True)
class NFTSettings:
    loss: NFTConfig
    num_timesteps: int = 4
    """Grid timesteps trained per sample (drawn without replacement from the sampler's T)."""
    micro_batch_size: int = 4
    num_inner_epochs: int = 1
    """Passes over one rollout batch, each with fresh timestep draws and noise."""
    num_minibatches: int = 1
    """Optimizer steps per pass: kept samples are shuffled and split into this many minibatches."""

    def __post_init__(self) -> None:
        check_counts(self, "num_timesteps", "micro_batch_size", "num_inner_epochs", "num_minibatches")


def plan_items(kept: Sequence[int], num_grid: int, settings: NFTSettings,
               generator: torch.Generator) -> list[list[Item]]:
    """The items of every optimizer step: per pass, per kept sample ``num_timesteps`` grid indices < ``num_grid``
    (a random permutation's head), then the samples shuffled and split into ``num_minibatches``."""
    if settings.num_timesteps > num_grid:
        raise ValueError(f"num_timesteps = {settings.num_timesteps} exceeds the sampler's {num_grid} steps")
    kept, plan = list(kept), []
    if not kept:
        return plan
    for _ in range(settings.num_inner_epochs):
        draws = {i: torch.randperm(num_grid, generator=generator)[:settings.num_timesteps].tolist() for i in kept}
        order = torch.randperm(len(kept), generator=generator)
        for chunk in torch.tensor_split(order, settings.num_minibatches):
            samples = [kept[j] for j in chunk.tolist()]
            if samples:
                plan.append([(i, k) for i in samples for k in draws[i]])
    return plan


def nft_microbatch_loss(velocity: torch.Tensor, mb: dict, *, config: NFTConfig, normalizer: float):
    loss, stats = nft_loss(velocity, mb["old_velocity"], mb["x0"], mb["latents"], mb["sigma"], mb["advantages"],
                           config=config, ref_velocity=mb.get("ref_velocity"), mask=mb["real"],
                           normalizer=normalizer)
    stats = {k: v.detach().float() for k, v in stats.items()}
    stats["num_real"] = mb["real"].sum().float()
    return loss, stats


def nft_update(trainer, trajs: Sequence[Trajectory], advantages: torch.Tensor, keep: torch.Tensor,
               settings: NFTSettings, *, generator: torch.Generator, old=None, ref=None, ema=None,
               device: torch.device | None = None) -> dict:
    """Every optimizer step of one rollout batch (docs/algorithms/nft.md); ``ema`` (ShadowWeights) is blended
    after each step (``EMA.step``). Returns item-weighted means of the loss stats, grad_norm (mean), update_ok
    (all), num_updates; {"skipped": 1.0} when nothing is kept."""
    device = device or current_device()
    kept = [i for i in range(len(keep)) if bool(keep[i])]
    plan = plan_items(kept, len(trajs[0].sigmas) - 1, settings, generator) if kept else []
    if not plan:
        return {"skipped": 1.0}
    shape = trajs[0].latents[-1].shape
    noise = [[torch.randn(shape, generator=generator) for _ in items] for items in plan]
    cond = batch_conditioning(trainer)
    steps = [clean_microbatches(trajs, advantages, items, eps, settings.micro_batch_size, device, cond,
                                algorithm="DiffusionNFT") for items, eps in zip(plan, noise)]
    with old.applied() if old is not None else contextlib.nullcontext():
        attach_velocities(trainer, steps, "old_velocity")
    if settings.loss.kl_beta > 0:
        if ref is None:
            raise ValueError(f"algo.kl_beta = {settings.loss.kl_beta} > 0 needs a reference model")
        attach_velocities(ref, steps, "ref_velocity")
    per_step = []
    for items, mbs in zip(plan, steps):
        normalizer = len(items) / (len(mbs) * ps.get_data_parallel_world_size())
        trainer.optimizer.zero_grad()
        results = trainer.forward_backward(mbs, partial(nft_microbatch_loss, config=settings.loss,
                                                        normalizer=normalizer))
        update_ok, grad_norm, _ = trainer.optimizer.step()
        if ema is not None:
            ema.step()
        per_step.append({**aggregate_stats(results), "grad_norm": float(grad_norm) if grad_norm is not None else
                         float("nan"), "update_ok": float(bool(update_ok)), "num_items": float(len(items))})
    return share_from_last_stage(combine_steps(per_step))
