"""DGPO in the megatron trainer: clean samples -> noised items -> one optimizer step (megaflow.algo.dgpo).

An item is kept sample i at grid index k (x_t = (1 − t)·x0 + t·ε); a preference group is one prompt group at one
timestep. A forward-only pre-pass attaches v_θ, v_ref (fast EMA; v_θ itself while the EMA is θ, before its first mixing
blend) and v_kl; group scores are summed over DP ranks.
Invariant: the draws and every ε come from the caller's generator before any DP split, so every layout trains on
the same items and noise; each real item weighs 1/N. Details: docs/algorithms/dgpo.md.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Sequence

import torch
from megatron.core import parallel_state as ps

from megaflow.algo.dgpo import DGPOConfig, GroupScores, dgpo_group_scores, dgpo_loss, matching_error
from megaflow.parallel.distributed import current_device
from megaflow.rollout.types import Trajectory
from megaflow.trainer.batch import (CleanItem, aggregate_stats, batch_conditioning, check_counts, clean_microbatches,
                                    combine_steps, share_from_last_stage, timed_pass)


@dataclass(frozen=True, kw_only=True)
class DGPOSettings:
    loss: DGPOConfig
    group_size: int
    """G: samples per prompt (rollout.group_size); consecutive samples form a prompt group."""
    num_timesteps: int = 4
    """Grid indices trained, drawn without replacement from 0 .. trunc_steps, shared by the batch."""
    trunc_steps: int = 4
    micro_batch_size: int = 4

    def __post_init__(self) -> None:
        check_counts(self, "group_size", "num_timesteps", "micro_batch_size")
        if self.trunc_steps < 0 or self.num_timesteps > self.trunc_steps + 1:
            raise ValueError(f"num_timesteps = {self.num_timesteps} needs trunc_steps >= num_timesteps - 1, "
                             f"got {self.trunc_steps}")


def plan_dgpo_items(kept: Sequence[int], num_grid: int, settings: DGPOSettings, shape: torch.Size,
                    generator: torch.Generator) -> tuple[list[CleanItem], torch.Tensor, list[torch.Tensor]]:
    """(items, their preference group ids [N], their noise): the batch's shared grid indices, then per kept
    sample (in order) one item per index; one ε per (prompt group, index) in order of first use."""
    if settings.trunc_steps >= num_grid:
        raise ValueError(f"trunc_steps = {settings.trunc_steps} needs more than the sampler's {num_grid} steps")
    slots = torch.randperm(settings.trunc_steps + 1, generator=generator)[:settings.num_timesteps].tolist()
    items, groups, noise, shared = [], [], [], {}
    for i in kept:
        for slot, k in enumerate(slots):
            gid = (i // settings.group_size) * settings.num_timesteps + slot
            if gid not in shared:
                shared[gid] = torch.randn(shape, generator=generator)
            items.append((i, k))
            groups.append(gid)
            noise.append(shared[gid])
    return items, torch.tensor(groups, dtype=torch.long), noise


def _group_scores(mbs: list[dict], items: Sequence[CleanItem], group_ids: torch.Tensor, advantages: torch.Tensor,
                  settings: DGPOSettings) -> GroupScores | None:
    """Every item's (s_g, n_g) from the pre-pass's errors of θ and of the reference, summed over the DP ranks
    (each item is real on one rank); None on the stages that hold no velocities."""
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    n = len(items)
    error = torch.zeros(2, n, dtype=torch.float64)
    for mb in mbs:
        real = mb["real"].cpu()
        pos = mb["item"].cpu()[real]
        for row, key in enumerate(("theta_velocity", "ref_velocity")):
            err = matching_error(mb[key], mb["x0"], mb["noise"]).cpu()
            error[row, pos] = err[real]
        del mb["theta_velocity"]
    if ps.get_data_parallel_world_size() > 1:
        torch.distributed.all_reduce(error, group=ps.get_data_parallel_group())
    adv = torch.stack([advantages[i] for i, _ in items]).double()
    return dgpo_group_scores(error[0], error[1], adv, group_ids, config=settings.loss,
                             group_size=settings.group_size)


def _on(scores: GroupScores, like: torch.Tensor) -> GroupScores:
    return GroupScores(scores.score.to(like.device), scores.count.to(like.device))


def dgpo_microbatch_loss(velocity: torch.Tensor, mb: dict, *, settings: DGPOSettings, scores: GroupScores,
                         normalizer: float):
    config = settings.loss
    loss, stats = dgpo_loss(velocity, mb["x0"], mb["noise"], mb["advantages"], mb["group"], config=config,
                            group_size=settings.group_size, ref_velocity=mb["ref_velocity"],
                            old_velocity=mb["ref_velocity"] if config.dgpo_clip_range > 0 else None,
                            kl_velocity=mb.get("kl_velocity"), scores=_on(scores.take(mb["item"].cpu()), velocity),
                            mask=mb["real"], normalizer=normalizer)
    stats = {k: v.detach().float() for k, v in stats.items()}
    stats["num_real"] = mb["real"].sum().float()
    return loss, stats


def dgpo_update(trainer, trajs: Sequence[Trajectory], advantages: torch.Tensor, keep: torch.Tensor,
                settings: DGPOSettings, *, generator: torch.Generator, ema_ref, ref=None, ema=None,
                device: torch.device | None = None) -> dict:
    """The optimizer step of one rollout batch (module doc); ``ema_ref`` (ShadowWeights) is the fast EMA,
    ``ema`` (the evaluation EMA) is stepped after the step. Returns the loss stats (item-weighted means),
    grad_norm, update_ok, num_updates; {"skipped": 1.0} when nothing is kept."""
    device = device or current_device()
    kept = [i for i in range(len(keep)) if bool(keep[i])]
    if not kept:
        return {"skipped": 1.0}
    items, group_ids, noise = plan_dgpo_items(kept, len(trajs[0].sigmas) - 1, settings, trajs[0].latents[-1].shape,
                                              generator)
    mbs = clean_microbatches(trajs, advantages, items, noise, settings.micro_batch_size, device,
                             batch_conditioning(trainer), algorithm="DGPO")
    for mb in mbs:
        mb["group"] = group_ids[mb["item"].cpu()].to(device)
    passes = {"time/theta_pass_s": timed_pass(trainer, [mbs], "theta_velocity")}
    if ema_ref.equals_live():  # the fast EMA is θ itself (before its first blend): v_ref is v_θ, bit for bit
        for mb in (mb for mb in mbs if "theta_velocity" in mb):  # the last pipeline stage's
            mb["ref_velocity"] = mb["theta_velocity"]
        passes["time/ema_pass_s"] = 0.0
    else:
        with ema_ref.applied():
            passes["time/ema_pass_s"] = timed_pass(trainer, [mbs], "ref_velocity")
    if settings.loss.kl_beta > 0:
        if ref is None:
            raise ValueError(f"algo.kl_beta = {settings.loss.kl_beta} > 0 needs a reference model")
        passes["time/ref_pass_s"] = timed_pass(ref, [mbs], "kl_velocity")
    scores = _group_scores(mbs, items, group_ids, advantages, settings)
    normalizer = len(items) / (len(mbs) * ps.get_data_parallel_world_size())
    t_policy = time.perf_counter()
    trainer.optimizer.zero_grad()
    results = trainer.forward_backward(mbs, partial(dgpo_microbatch_loss, settings=settings, scores=scores,
                                                    normalizer=normalizer))
    update_ok, grad_norm, _ = trainer.optimizer.step()
    if ema is not None:
        ema.step()
    passes["time/policy_s"] = time.perf_counter() - t_policy
    step = {**aggregate_stats(results), "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "update_ok": float(bool(update_ok)), "num_items": float(len(items))}
    return {**share_from_last_stage(combine_steps([step])), **passes}
