"""What every algorithm's update shares in the trainer: microbatch conditioning, this DP rank's share of items,
stats reduced to one row and sent to every stage; for the clean-sample algorithms (nft, awm, dgpo) the noised
microbatches, the forward-only velocity pass and the per-step rows combined.

Invariant: every DP rank runs the same number of microbatches (padding items are ``real=False`` and weigh
nothing), so the collectives of an update line up on every layout.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Callable, Sequence, TypeVar

import torch
from megatron.core import parallel_state as ps

from megaflow.rollout.types import Trajectory

Item = TypeVar("Item")
CleanItem = tuple[int, int]
"""(sample index, grid index k): the sample's final latent x0 noised at t = sigmas[k]."""
Conditioning = Callable[[Sequence[Trajectory], bool], dict]
"""(trajectories of one microbatch, cfg) -> the model's conditioning keys, batched (a family's
``batch_conditioning`` with its model config bound)."""


def batch_conditioning(trainer) -> Conditioning:
    """The microbatch conditioning of ``trainer``'s model family, bound to its model config."""
    return partial(trainer.family.batch_conditioning, trainer.config)


def dp_slice(items: list[Item], micro_batch_size: int) -> tuple[list[Item], list[bool]]:
    """This DP rank's items (strided), padded so every rank runs the same number of microbatches; under PP every
    microbatch is full. Padding items (``real`` False) weigh nothing."""
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_rank = -(-len(items) // dp)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        per_rank = -(-per_rank // micro_batch_size) * micro_batch_size
    mine = items[rank::dp]
    real = [True] * len(mine) + [False] * (per_rank - len(mine))
    return mine + [items[0]] * (per_rank - len(mine)), real


def aggregate_stats(results: list[dict], *, max_keys: Sequence[str] = (), min_keys: Sequence[str] = ()
                    ) -> dict[str, float]:
    """Item-weighted means (by each microbatch's ``num_real``) of per-microbatch stats; the algorithm's
    ``max_keys`` / ``min_keys`` take the max / min over the microbatches holding real items instead."""
    if not results:
        return {}
    w = torch.stack([r["num_real"].reshape(()) for r in results])
    out = {}
    for key in results[0]:
        vals = torch.stack([r[key].float().reshape(()) for r in results])
        if key == "num_real":
            continue
        if key in max_keys or key in min_keys:
            vals = vals[w > 0] if bool((w > 0).any()) else vals
            out[key] = float(vals.max() if key in max_keys else vals.min())
        else:
            out[key] = float((vals * w).sum() / w.sum().clamp(min=1))
    return out


def share_from_last_stage(stats: dict) -> dict:
    """The last pipeline stage's ``stats`` on every stage (unchanged without pipelining)."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return stats
    box = [stats if ps.is_pipeline_last_stage(ignore_virtual=True) else None]
    src = torch.distributed.get_global_rank(ps.get_pipeline_model_parallel_group(),
                                            ps.get_pipeline_model_parallel_world_size() - 1)
    torch.distributed.broadcast_object_list(box, src=src, group=ps.get_pipeline_model_parallel_group())
    return box[0]


def _stack_clean(trajs: Sequence[Trajectory], advantages: torch.Tensor, items: Sequence[CleanItem],
                 noise: Sequence[torch.Tensor], real: Sequence[bool], positions: Sequence[int],
                 conditioning: Conditioning, algorithm: str) -> dict:
    tr = [trajs[i] for i, _ in items]
    if any(x.do_cfg for x in tr):
        raise ValueError(f"{algorithm} trains without classifier-free guidance: sample with guidance off")
    x0 = torch.stack([x.latents[-1] for x in tr]).float()
    t = torch.stack([x.sigmas[k] for x, (_, k) in zip(tr, items)]).float()
    eps = torch.stack(list(noise))
    te = t.to(x0.dtype).view(-1, *([1] * (x0.dim() - 1)))
    is_real = torch.tensor(list(real), dtype=torch.bool)
    adv = torch.stack([advantages[i] for i, _ in items]).float()
    return {"latents": (1 - te) * x0 + te * eps, "sigma": t, "x0": x0, "noise": eps, **conditioning(tr, False),
            "advantages": torch.where(is_real, adv, torch.zeros_like(adv)), "real": is_real,
            "item": torch.tensor(list(positions), dtype=torch.long)}


def clean_microbatches(trajs, advantages, items: Sequence[CleanItem], noise: Sequence[torch.Tensor],
                       micro_batch_size: int, device, conditioning: Conditioning, *, algorithm: str) -> list[dict]:
    """This DP rank's microbatches of one optimizer step over ``items`` with their noise (one per item): x_t =
    (1 − t)·x0 + t·ε as ``latents``, ``sigma`` t, ``x0``, ``noise``, ``advantages``, ``real`` (padding items
    False) and ``item`` (each row's position in ``items``). ``algorithm`` names the refusal of CFG samples."""
    mine, real = dp_slice(list(range(len(items))), micro_batch_size)
    out = []
    for s in range(0, len(mine), micro_batch_size):
        idx = mine[s:s + micro_batch_size]
        mb = _stack_clean(trajs, advantages, [items[j] for j in idx], [noise[j] for j in idx],
                          real[s:s + micro_batch_size], idx, conditioning, algorithm)
        out.append({k: v.to(device) for k, v in mb.items()})
    return out


def attach_velocities(model, steps: list[list[dict]], key: str) -> None:
    """Forward-only pass of ``model`` over every microbatch of every step; the velocity goes to ``mb[key]``
    (the last pipeline stage gets velocities; other stages run the pass and keep nothing)."""
    flat = [mb for mbs in steps for mb in mbs]
    velocities = model.forward_backward(flat, None, forward_only=True)
    for mb, v in zip(flat, velocities):
        mb[key] = v.detach().float()


def timed_pass(model, steps: list[list[dict]], key: str) -> float:
    """``attach_velocities`` and its seconds (the device synchronised first on a GPU)."""
    t0 = time.perf_counter()
    attach_velocities(model, steps, key)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def combine_steps(per_step: list[dict]) -> dict:
    """One row for the optimizer steps of an update: item-weighted means (by ``num_items``), ``update_ok`` the
    min, ``grad_norm`` the mean, ``num_items`` the total, and ``num_updates``."""
    total = sum(s["num_items"] for s in per_step)
    out = {}
    for key in per_step[0]:
        vals = [s.get(key, float("nan")) for s in per_step]
        if key == "num_items":
            out[key] = total
        elif key == "update_ok":
            out[key] = min(vals)
        elif key == "grad_norm":
            out[key] = sum(vals) / len(vals)
        else:
            out[key] = sum(v * s["num_items"] for v, s in zip(vals, per_step)) / total
    out["num_updates"] = float(len(per_step))
    return out


def check_counts(settings: object, *names: str) -> None:
    """ValueError unless each named field of ``settings`` is an int >= 1 (the algorithms' settings' shared rule)."""
    for name in names:
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
