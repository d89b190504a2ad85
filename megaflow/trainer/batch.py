"""What every algorithm's update shares in the trainer: the model family's microbatch conditioning, this DP
rank's share of an optimizer step's items, the per-microbatch stats reduced to one row, and that row sent from
the last pipeline stage (where the loss runs) to every stage.

Invariant: every DP rank runs the same number of microbatches (padding items are ``real=False`` and weigh
nothing), so the collectives of an update line up on every layout.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Sequence, TypeVar

import torch
from megatron.core import parallel_state as ps

from megaflow.rollout.types import Trajectory

Item = TypeVar("Item")
Conditioning = Callable[[Sequence[Trajectory], bool], dict]
"""(trajectories of one microbatch, cfg) -> the model's conditioning keys, batched (a family's
``batch_conditioning`` with its model config bound)."""


def batch_conditioning(trainer) -> Conditioning:
    """The microbatch conditioning of ``trainer``'s model family, bound to its model config."""
    return partial(trainer.family.batch_conditioning, trainer.config)


def dp_slice(items: list[Item], micro_batch_size: int) -> tuple[list[Item], list[bool]]:
    """This DP rank's items (strided), padded so that every rank runs the same number of microbatches
    (``micro_batch_size`` items each, the last one possibly fewer). Under pipeline parallelism every
    microbatch is full: the stages exchange activations of one fixed shape. Padding items (``real`` False)
    are computed and weigh nothing, so without pipelining a rank pads at most one item."""
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
