"""AWM in the megatron trainer: clean samples -> noised items -> optimizer steps (megaflow.algo.awm).

An item is kept sample i at sampler grid index k: x_t = (1 − t)·x0 + t·ε, t = ``sigmas[k]``; a forward-only
pre-pass attaches v_ema, v_ref (KL) and v_old (several steps: the steps after the first) before the first update.
Invariant: the draws, the shuffle and every ε come from the caller's generator in item order, before any DP split,
so every layout trains on the same items and noise; each real item weighs 1/N. Details: docs/algorithms/awm.md.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Sequence

import torch
from megatron.core import parallel_state as ps

from megaflow.algo.awm import AWMConfig, awm_loss, awm_timestep_indices
from megaflow.parallel.distributed import current_device
from megaflow.rollout.types import Trajectory
from megaflow.trainer.batch import (CleanItem, aggregate_stats, batch_conditioning, check_counts, clean_microbatches,
                                    combine_steps, share_from_last_stage, timed_pass)


@dataclass(frozen=True, kw_only=True)
class AWMSettings:
    loss: AWMConfig
    num_timesteps: int = 6
    """Grid indices trained per sample, one per stratum of [1, int(T·timestep_fraction)]."""
    timestep_fraction: float = 0.9
    micro_batch_size: int = 4
    num_inner_epochs: int = 1
    """Passes over one rollout batch, each with fresh timestep draws and noise."""
    num_minibatches: int = 1
    """Optimizer steps per pass: kept samples are shuffled and split into this many minibatches."""

    def __post_init__(self) -> None:
        check_counts(self, "num_timesteps", "micro_batch_size", "num_inner_epochs", "num_minibatches")
        if not 0.0 < self.timestep_fraction <= 1.0:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {self.timestep_fraction!r}")


def plan_awm_items(kept: Sequence[int], num_grid: int, settings: AWMSettings,
                   generator: torch.Generator) -> list[list[CleanItem]]:
    """The items of every optimizer step: per pass, per kept sample its stratified grid indices (< ``num_grid``),
    then the samples shuffled and split into ``num_minibatches``."""
    kept, plan = list(kept), []
    for _ in range(settings.num_inner_epochs if kept else 0):
        draws = {i: awm_timestep_indices(num_grid, settings.num_timesteps, settings.timestep_fraction,
                                         generator=generator) for i in kept}
        order = torch.randperm(len(kept), generator=generator)
        for chunk in torch.tensor_split(order, settings.num_minibatches):
            samples = [kept[j] for j in chunk.tolist()]
            if samples:
                plan.append([(i, k) for i in samples for k in draws[i]])
    return plan


def awm_microbatch_loss(velocity: torch.Tensor, mb: dict, *, config: AWMConfig, normalizer: float):
    loss, stats = awm_loss(velocity, mb["x0"], mb["noise"], mb["sigma"], mb["advantages"], config=config,
                           old_velocity=mb.get("old_velocity"), ref_velocity=mb.get("ref_velocity"),
                           ema_velocity=mb.get("ema_velocity"), mask=mb["real"], normalizer=normalizer)
    stats = {k: v.detach().float() for k, v in stats.items()}
    stats["num_real"] = mb["real"].sum().float()
    return loss, stats


def _pre_pass(trainer, steps: list[list[dict]], settings: AWMSettings, ema_kl, ref) -> dict[str, float]:
    """v_old (the optimizer steps after the first: the first step's θ_old is θ itself, its ratio 1), v_ema and v_ref
    on every microbatch, before the first step; each pass's seconds."""
    seconds = {}
    if len(steps) > 1:
        seconds["time/old_pass_s"] = timed_pass(trainer, steps[1:], "old_velocity")
    if settings.loss.awm_ema_kl_beta > 0:
        if ema_kl is None:
            raise ValueError(f"algo.awm_ema_kl_beta = {settings.loss.awm_ema_kl_beta} > 0 needs the fast EMA")
        with ema_kl.applied():
            seconds["time/ema_pass_s"] = timed_pass(trainer, steps, "ema_velocity")
    if settings.loss.kl_beta > 0:
        if ref is None:
            raise ValueError(f"algo.kl_beta = {settings.loss.kl_beta} > 0 needs a reference model")
        seconds["time/ref_pass_s"] = timed_pass(ref, steps, "ref_velocity")
    return seconds


def awm_update(trainer, trajs: Sequence[Trajectory], advantages: torch.Tensor, keep: torch.Tensor,
               settings: AWMSettings, *, generator: torch.Generator, ema_kl=None, ref=None, ema=None,
               device: torch.device | None = None) -> dict:
    """Every optimizer step of one rollout batch (module doc); ``ema`` (the evaluation EMA) is stepped after
    each. Returns item-weighted means of the loss stats, grad_norm (mean), update_ok (all), num_updates;
    {"skipped": 1.0} when nothing is kept."""
    device = device or current_device()
    kept = [i for i in range(len(keep)) if bool(keep[i])]
    plan = plan_awm_items(kept, len(trajs[0].sigmas) - 1, settings, generator) if kept else []
    if not plan:
        return {"skipped": 1.0}
    shape = trajs[0].latents[-1].shape
    noise = [[torch.randn(shape, generator=generator) for _ in items] for items in plan]
    cond = batch_conditioning(trainer)
    steps = [clean_microbatches(trajs, advantages, items, eps, settings.micro_batch_size, device, cond,
                                algorithm="AWM") for items, eps in zip(plan, noise)]
    passes = _pre_pass(trainer, steps, settings, ema_kl, ref)
    per_step = []
    t_policy = time.perf_counter()
    for items, mbs in zip(plan, steps):
        normalizer = len(items) / (len(mbs) * ps.get_data_parallel_world_size())
        trainer.optimizer.zero_grad()
        results = trainer.forward_backward(mbs, partial(awm_microbatch_loss, config=settings.loss,
                                                        normalizer=normalizer))
        update_ok, grad_norm, _ = trainer.optimizer.step()
        if ema is not None:
            ema.step()
        per_step.append({**aggregate_stats(results), "grad_norm": float(grad_norm) if grad_norm is not None else
                         float("nan"), "update_ok": float(bool(update_ok)), "num_items": float(len(items))})
    passes["time/policy_s"] = time.perf_counter() - t_policy
    return {**share_from_last_stage(combine_steps(per_step)), **passes}
