"""FlowGRPO in the megatron trainer: ``grpo_update`` (every optimizer step of one rollout batch) and
``grpo_train_step`` (one step of the PPO-clip loss on recomputed per-step log-probs).

Invariant: every real (sample, step) item of an optimizer step weighs 1/N in the gradient on every TP / PP / DP
layout; padding adds exactly zero. Derivation and CFG: docs/algorithms/flowgrpo.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Sequence

import torch
from megatron.core import parallel_state as ps

from megaflow.algo.flowgrpo import LossConfig, MismatchConfig, flow_grpo_loss, mismatch_weights
from megaflow.flow.step import TransitionConfig, transition_log_prob, transition_mean_std
from megaflow.parallel.distributed import current_device
from megaflow.rollout.types import Trajectory
from megaflow.trainer.batch import aggregate_stats, batch_conditioning, check_counts, share_from_last_stage
from megaflow.trainer.flowgrpo_batches import (
    guided_velocity,
    microbatches_for,
    num_samples,
    plan_updates,
    policy_input,
)

_MAX_KEYS = ("logp_abs_diff_rollout", "ratio_max")
_MIN_KEYS = ("ratio_min",)


@dataclass(frozen=True, kw_only=True)
class GRPOSettings:
    transition: TransitionConfig
    loss: LossConfig
    mismatch: MismatchConfig | None = None
    micro_batch_size: int = 4
    num_inner_epochs: int = 1
    """Passes over one rollout batch (flow_grpo ``train.num_inner_epochs``)."""
    num_minibatches: int = 1
    """Optimizer steps per pass: kept samples are shuffled and split into this many minibatches."""

    def __post_init__(self) -> None:
        check_counts(self, "micro_batch_size", "num_inner_epochs", "num_minibatches")


def build_microbatches(trainer, trajs: Sequence[Trajectory], advantages: torch.Tensor, keep: torch.Tensor,
                       steps: Sequence[int], micro_batch_size: int, device: torch.device) -> list[dict]:
    """This DP rank's microbatches of ONE optimizer step over every kept (sample, step) item for ``trainer``."""
    (items,) = plan_updates(_kept(keep), steps) or [[]]
    return microbatches_for(trajs, advantages, items, micro_batch_size, device,
                            conditioning=batch_conditioning(trainer))


def _kept(keep: torch.Tensor) -> list[int]:
    return [i for i in range(len(keep)) if bool(keep[i])]


def _velocity_mean(mb: dict, velocity: torch.Tensor, transition: TransitionConfig) -> torch.Tensor:
    v = guided_velocity(velocity.detach(), mb)
    mean, _, _ = transition_mean_std(policy_input(mb), v, mb["sigma"][:num_samples(mb)], mb["sigma_next"],
                                     sigma_max=mb["sigma_max"], config=transition)
    return mean


def attach_reference(reference, microbatches: list[dict], transition: TransitionConfig) -> None:
    """Add ``ref_mean`` (the frozen reference policy's step mean) to every microbatch (for the KL)."""
    velocities = reference.forward_backward(microbatches, None, forward_only=True)
    for mb, v in zip(microbatches, velocities):  # empty on non-last pipeline stages (no loss there)
        mb["ref_mean"] = _velocity_mean(mb, v, transition).detach()


def _policy(velocity: torch.Tensor, mb: dict, transition: TransitionConfig):
    n = num_samples(mb)
    return transition_log_prob(policy_input(mb), guided_velocity(velocity, mb), mb["x_next"], mb["sigma"][:n],
                               mb["sigma_next"], sigma_max=mb["sigma_max"], config=transition)


def grpo_loss(velocity: torch.Tensor, mb: dict, *, settings: GRPOSettings, normalizer: float):
    """Loss of one microbatch (last pipeline stage): Σ over its real items / ``normalizer``; detached stats
    are means over its real items plus ``num_real``."""
    policy = _policy(velocity, mb, settings.transition)
    mask = mb["real"]
    old, weights, stats_extra = mb["rollout_log_prob"], None, {}
    if settings.mismatch is not None and "is_weight" in mb:  # precomputed over whole samples (grpo_update)
        old, weights, mask = mb["old_log_prob"], mb["is_weight"], mask & mb["is_keep"]
    elif settings.mismatch is not None:
        if settings.mismatch.mismatch_level != "step":
            raise ValueError(f"mismatch_level={settings.mismatch.mismatch_level!r} needs the weights of every "
                             "trained step of a sample: build the microbatches with grpo_update")
        old = policy.log_prob.detach()
        mw = mismatch_weights(old, mb["rollout_log_prob"], settings.mismatch, mask=mask)
        weights, mask = mw.weights, mw.keep
        stats_extra = {k: v.detach() for k, v in mw.stats.items()}
    loss, stats = flow_grpo_loss(policy, old_log_prob=old, advantages=mb["advantages"], config=settings.loss,
                                 ref_mean=mb.get("ref_mean"), mask=mask, is_weights=weights, normalizer=normalizer)
    diff = (policy.log_prob.detach() - mb["rollout_log_prob"]).abs()
    stats = {k: v.detach().float() for k, v in {**stats, **stats_extra}.items()}
    stats["logp_abs_diff_rollout"] = torch.where(mb["real"], diff, torch.zeros_like(diff)).max()
    stats["num_real"] = mb["real"].sum().float()
    return loss, stats


def _global_real_count(microbatches: list[dict]) -> int:
    count = torch.tensor(float(sum(int(mb["real"].sum()) for mb in microbatches)))
    if ps.get_data_parallel_world_size() > 1:
        group = ps.get_data_parallel_group()
        count = count.to(next(iter(microbatches[0].values())).device)
        torch.distributed.all_reduce(count, group=group)
    return int(count.item())


def grpo_train_step(trainer, microbatches: list[dict], settings: GRPOSettings, reference=None, *,
                    num_items: int | None = None) -> dict:
    """One optimizer step over this DP rank's ``microbatches``; ``num_items``: the global count of real items
    (None = one all-reduce). Returns item-weighted means, grad_norm, update_ok, num_microbatches, num_items."""
    if getattr(trainer.config, "calculate_per_token_loss", False):
        raise ValueError("the GRPO step normalises by the global item count itself and needs megatron's "
                         "calculate_per_token_loss=False")
    if settings.loss.kl_beta > 0:
        if reference is None:
            raise ValueError(f"algo.kl_beta = {settings.loss.kl_beta} > 0 needs a reference model")
        attach_reference(reference, microbatches, settings.transition)
    n = _global_real_count(microbatches) if num_items is None else int(num_items)
    if n < 1:
        raise ValueError(f"num_items must be >= 1 (real items in this step), got {n}")
    normalizer = n / (len(microbatches) * ps.get_data_parallel_world_size())
    trainer.optimizer.zero_grad()
    results = trainer.forward_backward(microbatches, partial(grpo_loss, settings=settings, normalizer=normalizer))
    update_ok, grad_norm, _ = trainer.optimizer.step()
    stats: dict[str, float] = {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                               "update_ok": float(bool(update_ok)), "num_microbatches": float(len(microbatches)),
                               "num_items": float(n)}
    stats.update(aggregate_stats(results, max_keys=_MAX_KEYS, min_keys=_MIN_KEYS))
    return share_from_last_stage(stats)


def _pre_update_log_probs(trainer, trajs, advantages, items, settings: GRPOSettings, device) -> dict:
    """The trainer's log-prob of every item under the current weights (before any update), on every DP
    rank of the last pipeline stage ({} elsewhere): the old policy of mismatch correction."""
    mbs = microbatches_for(trajs, advantages, items, settings.micro_batch_size, device,
                           conditioning=batch_conditioning(trainer))
    velocities = trainer.forward_backward(mbs, None, forward_only=True)
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    log_probs = []
    for mb, v in zip(mbs, velocities):  # this rank's items in order, padding at the end
        lp = _policy(v.detach(), mb, settings.transition).log_prob.cpu()
        log_probs.extend(lp[mb["real"].cpu()])
    mine = dict(zip(items[rank::dp], log_probs)) if velocities else {}
    if dp > 1:
        parts = [None] * dp
        torch.distributed.all_gather_object(parts, mine, group=ps.get_data_parallel_group())
        mine = {k: v for part in parts for k, v in part.items()}
    return mine


def grpo_update(trainer, trajs: Sequence[Trajectory], advantages: torch.Tensor, keep: torch.Tensor,
                steps: Sequence[int], settings: GRPOSettings, reference=None, *, seed: int = 0,
                device: torch.device | None = None, ema=None) -> dict:
    """Every optimizer step of ``plan_updates`` for one rollout batch; ``ema`` steps after each. Returns
    item-weighted means, grad_norm (mean), update_ok (all), num_updates (``logp_abs_diff_rollout`` from the first
    step, ``clip_frac_stale`` from the later ones); {"skipped": 1.0} when nothing is kept."""
    device = device or current_device()
    plan = plan_updates(_kept(keep), steps, num_inner_epochs=settings.num_inner_epochs,
                        num_minibatches=settings.num_minibatches, seed=seed)
    if not plan:
        return {"skipped": 1.0}
    mismatch, is_stats = None, {}
    if settings.mismatch is not None and (len(plan) > 1 or settings.mismatch.mismatch_level != "step"):
        every_item = sorted({it for items in plan for it in items})
        old = _pre_update_log_probs(trainer, trajs, advantages, every_item, settings, device)
        if old:  # {} off the last pipeline stage, where no loss runs
            mismatch, is_stats = _item_mismatch_weights(old, trajs, every_item, settings.mismatch)
    per_step = []
    for items in plan:
        mbs = microbatches_for(trajs, advantages, items, settings.micro_batch_size, device, mismatch=mismatch,
                               conditioning=batch_conditioning(trainer))
        per_step.append(grpo_train_step(trainer, mbs, settings, reference, num_items=len(items)))
        if ema is not None:
            ema.step()
    return {**_combine_steps(per_step), **share_from_last_stage(is_stats)}


def _item_mismatch_weights(old: dict, trajs: Sequence[Trajectory], items: Sequence[tuple[int, int]],
                           config: MismatchConfig) -> tuple[dict, dict[str, float]]:
    """Every item's (old log-prob, weight, keep) from ``mismatch_weights`` over ``[K, T]``: the K samples
    of ``items`` by the union of their steps, masked to the items present, so the trajectory / geometric
    aggregate covers exactly each sample's trained steps. Returns the per-item triples and the stats."""
    samples = sorted({i for i, _ in items})
    steps = sorted({t for _, t in items})
    row, col = {i: k for k, i in enumerate(samples)}, {t: k for k, t in enumerate(steps)}
    train = torch.zeros(len(samples), len(steps))
    rollout = torch.zeros_like(train)
    mask = torch.zeros_like(train, dtype=torch.bool)
    for i, t in items:
        train[row[i], col[t]] = old[(i, t)].reshape(()).float()
        rollout[row[i], col[t]] = trajs[i].log_probs[t].float()
        mask[row[i], col[t]] = True
    mw = mismatch_weights(train, rollout, config, mask=mask)
    per_item = {(i, t): (train[row[i], col[t]], mw.weights[row[i], col[t]], mw.keep[row[i], col[t]])
                for i, t in items}
    return per_item, {k: float(v) for k, v in mw.stats.items()}


def _combine_steps(per_step: list[dict]) -> dict:
    first = per_step[0]
    w = [s["num_items"] for s in per_step]
    out = {}
    for key in first:
        vals = [s.get(key, float("nan")) for s in per_step]
        if key == "logp_abs_diff_rollout":
            out[key] = first[key]
        elif key in ("num_microbatches", "num_items"):
            out[key] = float(sum(vals))
        elif key == "update_ok":
            out[key] = float(min(vals))
        elif key in _MAX_KEYS:
            out[key] = max(vals)
        elif key in _MIN_KEYS:
            out[key] = min(vals)
        elif key == "grad_norm":
            out[key] = sum(vals) / len(vals)
        else:
            out[key] = sum(v * n for v, n in zip(vals, w)) / sum(w)
    out["num_updates"] = float(len(per_step))
    if len(per_step) > 1 and "clip_frac" in first:
        later = per_step[1:]
        total = sum(s["num_items"] for s in later)
        out["clip_frac_stale"] = sum(s["clip_frac"] * s["num_items"] for s in later) / total
    return out
