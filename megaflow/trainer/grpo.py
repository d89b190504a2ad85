"""FlowGRPO in the megatron trainer: trajectories -> (sample, step) microbatches -> PPO-clip loss.

Each trained item is one denoising step of one kept sample: the trainer recomputes
log p_theta(x_{t+1} | x_t) with its own velocity (the engine's log-prob depends only on the noise
and the sigma grid, FACTS §3, so it cannot stand in for the policy's) and applies the FlowGRPO
objective (megaflow.algo.loss). One optimizer step per rollout batch, accumulated over all
microbatches through megatron's schedule, as flow_grpo accumulates over timesteps.

Old policy: with one update per batch, the policy before the update IS the sampling policy, so
``old_log_prob`` is the engine's rollout log-prob; with mismatch correction on, the trainer's own
detached log-prob is the old policy and w = f(exp(logp_train - logp_rollout)) reweights the loss
(TIS / MIS, megaflow.algo.loss.mismatch_weights).

Data parallelism: every rank receives the whole batch; DP rank r trains items r, r + dp, ...,
padded with zero-advantage copies so every DP rank runs the same number of microbatches.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Sequence

import torch
from megatron.core import parallel_state as ps

from megaflow.algo.loss import LossConfig, MismatchConfig, flow_grpo_loss, mismatch_weights
from megaflow.flow.step import TransitionConfig, sigma_max_of, transition_log_prob, transition_mean_std
from megaflow.rollout.types import Trajectory


@dataclass(frozen=True, kw_only=True)
class GRPOSettings:
    transition: TransitionConfig
    loss: LossConfig
    mismatch: MismatchConfig | None = None
    micro_batch_size: int = 4


def _items(trajs: Sequence[Trajectory], keep: torch.Tensor, steps: Sequence[int]) -> list[tuple[int, int]]:
    return [(i, t) for i in range(len(trajs)) if bool(keep[i]) for t in steps]


def _dp_slice(items: list, micro_batch_size: int) -> tuple[list, list[bool]]:
    """This DP rank's items (strided), padded to a whole number of equal-count microbatches."""
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = -(-len(items) // dp)
    per_rank = -(-per_rank // micro_batch_size) * micro_batch_size
    mine = items[rank::dp]
    real = [True] * len(mine) + [False] * (per_rank - len(mine))
    mine = mine + [items[0]] * (per_rank - len(mine))
    return mine, real


def build_microbatches(trajs: Sequence[Trajectory], advantages: torch.Tensor, keep: torch.Tensor,
                       steps: Sequence[int], micro_batch_size: int, device: torch.device) -> list[dict]:
    """Stack (sample, step) items into microbatches (the TrainEngine microbatch protocol + GRPO keys)."""
    items = _items(trajs, keep, steps)
    if not items:
        return []
    mine, real = _dp_slice(items, micro_batch_size)
    out = []
    for start in range(0, len(mine), micro_batch_size):
        chunk, is_real = mine[start:start + micro_batch_size], real[start:start + micro_batch_size]
        tr = [trajs[i] for i, _ in chunk]
        ts = [t for _, t in chunk]
        adv = torch.stack([advantages[i] for i, _ in chunk]).float()
        adv = adv * torch.tensor(is_real, dtype=torch.float32)
        mb = {
            "latents": torch.stack([x.latents[t] for x, t in zip(tr, ts)]),
            "x_next": torch.stack([x.latents[t + 1] for x, t in zip(tr, ts)]),
            "sigma": torch.stack([x.sigmas[t] for x, t in zip(tr, ts)]).float(),
            "sigma_next": torch.stack([x.sigmas[t + 1] for x, t in zip(tr, ts)]).float(),
            "sigma_max": torch.stack([sigma_max_of(x.sigmas) for x in tr]).float(),
            "encoder_hidden_states": torch.stack([x.conditioning["encoder_hidden_states"] for x in tr]),
            "pooled_projections": torch.stack([x.conditioning["pooled_projections"] for x in tr]),
            "rollout_log_prob": torch.stack([x.log_probs[t] for x, t in zip(tr, ts)]).float(),
            "advantages": adv,
            "real": torch.tensor(is_real),
        }
        out.append({k: v.to(device) for k, v in mb.items()})
    return out


def attach_reference(ref_engine, microbatches: list[dict], transition: TransitionConfig) -> None:
    """Add ``ref_mean`` (the frozen reference policy's step mean) to every microbatch (for the KL)."""
    velocities = ref_engine.forward_backward(microbatches, None, forward_only=True)
    for mb, v in zip(microbatches, velocities):  # empty on non-last pipeline stages (no loss there)
        mean, _, _ = transition_mean_std(mb["latents"], v.detach(), mb["sigma"], mb["sigma_next"],
                                         sigma_max=mb["sigma_max"], config=transition)
        mb["ref_mean"] = mean.detach()


def grpo_loss(velocity: torch.Tensor, mb: dict, *, settings: GRPOSettings):
    """Loss of one microbatch (runs on the last pipeline stage); returns (loss, detached stats)."""
    policy = transition_log_prob(mb["latents"], velocity, mb["x_next"], mb["sigma"], mb["sigma_next"],
                                 sigma_max=mb["sigma_max"], config=settings.transition)
    mask = mb["real"]
    old, weights, stats_extra = mb["rollout_log_prob"], None, {}
    if settings.mismatch is not None:
        old = policy.log_prob.detach()
        mw = mismatch_weights(old, mb["rollout_log_prob"], settings.mismatch, mask=mask)
        weights, mask = mw.weights, mw.keep
        stats_extra = {k: v.detach() for k, v in mw.stats.items()}
    loss, stats = flow_grpo_loss(policy, old_log_prob=old, advantages=mb["advantages"], config=settings.loss,
                                 ref_mean=mb.get("ref_mean"), mask=mask, is_weights=weights)
    train_vs_rollout = (policy.log_prob.detach() - mb["rollout_log_prob"]).abs()
    stats = {k: v.detach().float() for k, v in {**stats, **stats_extra}.items()}
    stats["logp_abs_diff_rollout"] = train_vs_rollout.max()
    return loss, stats


def grpo_train_step(engine, microbatches: list[dict], settings: GRPOSettings, ref_engine=None) -> dict:
    """One optimizer step over ``microbatches``; returns mean stats (on every rank)."""
    if settings.loss.beta > 0:
        if ref_engine is None:
            raise ValueError(f"algo.kl_beta = {settings.loss.beta} > 0 needs a reference model")
        attach_reference(ref_engine, microbatches, settings.transition)
    engine.optimizer.zero_grad()
    results = engine.forward_backward(microbatches, partial(grpo_loss, settings=settings))
    update_ok, grad_norm, _ = engine.optimizer.step()
    stats: dict[str, float] = {"grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                               "update_ok": float(bool(update_ok)), "num_microbatches": float(len(microbatches))}
    if results:
        for key in results[0]:
            vals = torch.stack([r[key].float().reshape(()) for r in results])
            stats[key] = float(vals.max() if key == "logp_abs_diff_rollout" else vals.mean())
    return _share_from_last_stage(stats)


def _share_from_last_stage(stats: dict) -> dict:
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return stats
    box = [stats if ps.is_pipeline_last_stage(ignore_virtual=True) else None]
    src = torch.distributed.get_global_rank(ps.get_pipeline_model_parallel_group(),
                                            ps.get_pipeline_model_parallel_world_size() - 1)
    torch.distributed.broadcast_object_list(box, src=src, group=ps.get_pipeline_model_parallel_group())
    return box[0]
