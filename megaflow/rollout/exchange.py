"""A host's share of a rollout (trajectories + rewards) as tensors, and its broadcast to every rank.
Design notes: docs/design/rollout.md.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaflow.parallel.groups import as_group
from megaflow.rollout.types import RewardScores, RolloutRequest, Trajectory

_TRAJ, _COMPONENT, _INFO = "traj.", "reward.component.", "reward.info."


def pack_share(trajs: Sequence[Trajectory], scores: RewardScores | None,
               sample_seconds: float) -> dict[str, torch.Tensor]:
    """Named tensors of ``trajs`` (in order), their ``scores`` (None: unscored samples) and the host's sampling
    wall time."""
    out: dict[str, torch.Tensor] = {}
    for f in dataclasses.fields(Trajectory):
        first = getattr(trajs[0], f.name)
        if isinstance(first, torch.Tensor):
            out[_TRAJ + f.name] = torch.stack([getattr(t, f.name) for t in trajs])
        elif isinstance(first, dict) and first and all(isinstance(v, torch.Tensor) for v in first.values()):
            for key, value in _stacked([getattr(t, f.name) for t in trajs]).items():
                out[f"{_TRAJ}{f.name}.{key}"] = value
    out["time.sample_s"] = torch.tensor([sample_seconds], dtype=torch.float64)
    if scores is None:
        return out
    labels = list(scores.components)
    out["reward.total"] = scores.total
    out.update({_COMPONENT + label: scores.components[label] for label in labels})
    out["reward.seconds"] = torch.tensor([scores.seconds[label] for label in labels], dtype=torch.float64)
    out["reward.weights"] = torch.tensor([scores.weights[label] for label in labels], dtype=torch.float64)
    out["reward.timeouts"] = torch.tensor([scores.timeouts.get(label, 0) for label in labels], dtype=torch.int64)
    out.update({_INFO + key: torch.tensor([value], dtype=torch.float64) for key, value in scores.info.items()})
    return out


def _stacked(dicts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each key's tensors stacked over the samples. A key whose tensors differ in length (the first axis: prompt
    embeddings of different token counts, Qwen-Image's) or whose ``<key>_mask`` only some samples carry is
    zero-padded to the longest, with ``<key>_mask`` [B, L] (True: a real row; a sample's own mask kept)."""
    keys = list(dict.fromkeys(k for d in dicts for k in d))
    out = {}
    for key in keys:
        if key.endswith("_mask") and key.removesuffix("_mask") in keys:
            continue  # stacked with its tensor
        tensors, masks = [d[key] for d in dicts], [d.get(f"{key}_mask") for d in dicts]
        same = all(t.shape == tensors[0].shape for t in tensors)
        if same and (all(m is None for m in masks) or all(m is not None for m in masks)):
            out[key] = torch.stack(tensors)
            if masks[0] is not None:
                out[f"{key}_mask"] = torch.stack(masks)
            continue
        longest = max(t.shape[0] for t in tensors)
        out[key] = torch.stack([F.pad(t, (0, 0) * (t.dim() - 1) + (0, longest - t.shape[0])) for t in tensors])
        out[f"{key}_mask"] = torch.stack([
            F.pad((torch.ones(t.shape[0], dtype=torch.bool) if m is None else m.bool()), (0, longest - t.shape[0]))
            for t, m in zip(tensors, masks)])
    return out


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a rollout share header")
    return dtype


def broadcast_share(share: dict[str, torch.Tensor] | None, src: int, group) -> dict[str, torch.Tensor]:
    """``share`` from launch rank ``src`` on every rank of ``group`` (a megaflow.parallel.groups.Group or a
    registered gloo group; ``share`` is read on ``src`` only): one header broadcast, then one flat uint8
    tensor. CPU tensors."""
    g = as_group(group)
    header = g.broadcast_object([(n, tuple(t.shape), str(t.dtype)) for n, t in share.items()]
                                if share is not None else None, src)
    spec = [(name, shape, _dtype(dtype)) for name, shape, dtype in header]
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for _, shape, dtype in spec]
    if share is not None:
        flat = torch.cat([t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in share.values()])
    else:
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
    dist.broadcast(flat, group=g.pg, group_src=g.rank_of(src))
    out, offset = {}, 0
    for (name, shape, dtype), size in zip(spec, sizes):
        out[name] = flat[offset:offset + size].clone().view(dtype).reshape(shape)  # own, aligned storage
        offset += size
    return out


def unpack_share(share: dict[str, torch.Tensor], requests: Sequence[RolloutRequest],
                 host: int) -> tuple[list[Trajectory], RewardScores | None]:
    """The trajectories (request order, then output index) and scores (None for an unscored share) ``share``
    carries for ``requests``."""
    tensors: dict[str, dict[str, torch.Tensor] | torch.Tensor] = {}
    for name, value in share.items():
        if name.startswith(_TRAJ):
            field, _, key = name[len(_TRAJ):].partition(".")
            if key:
                tensors.setdefault(field, {})[key] = value
            else:
                tensors[field] = value
    trajs, i = [], 0
    for r in requests:
        for j, seed in enumerate(r.output_seeds()):
            fields = {k: ({kk: vv[i] for kk, vv in v.items()} if isinstance(v, dict) else v[i])
                      for k, v in tensors.items()}
            trajs.append(Trajectory(**r.trajectory_fields(), index=j, seed=seed,
                                    log_prob_no_const=r.log_prob_no_const, engine_id=f"host{host}", **fields))
            i += 1
    sent = next(v for k, v in share.items() if k.startswith(_TRAJ)).shape[0]
    if i != sent:
        raise ValueError(f"host {host} sent {sent} samples for {i} requested")
    if "reward.total" not in share:
        return trajs, None
    labels = [n[len(_COMPONENT):] for n in share if n.startswith(_COMPONENT)]
    scores = RewardScores(total=share["reward.total"], components={k: share[_COMPONENT + k] for k in labels},
                          weights=dict(zip(labels, share["reward.weights"].tolist())),
                          seconds=dict(zip(labels, share["reward.seconds"].tolist())),
                          timeouts=dict(zip(labels, share["reward.timeouts"].tolist())),
                          info={n[len(_INFO):]: float(v[0]) for n, v in share.items() if n.startswith(_INFO)})
    return trajs, scores
