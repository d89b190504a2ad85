"""FlowGRPO's training data: (sample, step) items -> optimizer steps (``plan_updates``) -> this DP rank's
microbatches (``microbatches_for``), both CFG branches when the rollout used CFG.

Invariant: the plan depends on the kept samples, trained steps and seed alone, so every rank builds the same.
Details: docs/algorithms/flowgrpo.md ("In the trainer").
"""
from __future__ import annotations

from typing import Sequence

import torch

from megaflow.flow.step import sigma_max_of
from megaflow.rollout.types import Trajectory
from megaflow.trainer.batch import Conditioning, dp_slice

Item = tuple[int, int]


def plan_updates(kept: Sequence[int], steps: Sequence[int], *, num_inner_epochs: int = 1,
                 num_minibatches: int = 1, seed: int = 0) -> list[list[Item]]:
    """The items of every optimizer step, in order (docs/algorithms/flowgrpo.md); empty minibatches are dropped."""
    if num_inner_epochs < 1 or num_minibatches < 1:
        raise ValueError(f"num_inner_epochs={num_inner_epochs!r} and num_minibatches={num_minibatches!r} must be >= 1")
    kept, steps = list(kept), list(steps)
    if not kept or not steps:
        return []
    if num_inner_epochs == 1 and num_minibatches == 1:
        return [[(i, t) for i in kept for t in steps]]
    g = torch.Generator().manual_seed(seed)
    plan = []
    for _ in range(num_inner_epochs):
        perm = torch.randperm(len(kept), generator=g).tolist()
        order = [steps[j] for j in torch.randperm(len(steps), generator=g).tolist()]
        for chunk in torch.tensor_split(torch.tensor(perm), num_minibatches):
            samples = [kept[j] for j in chunk.tolist()]
            if samples:
                plan.append([(i, t) for t in order for i in samples])
    return plan


def stack_items(trajs: Sequence[Trajectory], advantages: torch.Tensor, items: Sequence[Item],
                real: Sequence[bool], device: torch.device,
                mismatch: dict[Item, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None, *,
                conditioning: Conditioning) -> dict:
    """One microbatch of ``items``; ``mismatch``: item -> (old log-prob, weight, keep), stacked as
    ``old_log_prob``, ``is_weight`` and ``is_keep``."""
    tr = [trajs[i] for i, _ in items]
    ts = [t for _, t in items]
    cfg = {bool(x.do_cfg) for x in tr}
    if len(cfg) > 1:
        raise ValueError("a microbatch mixes CFG and CFG-free trajectories; sample one batch with one setting")
    cfg = cfg.pop()
    is_real = torch.tensor(list(real), dtype=torch.bool)
    adv = torch.stack([advantages[i] for i, _ in items]).float()
    latents = torch.stack([x.latents[t] for x, t in zip(tr, ts)])
    sigma = torch.stack([x.sigmas[t] for x, t in zip(tr, ts)]).float()
    mb = {
        "latents": torch.cat([latents, latents]) if cfg else latents,
        "sigma": torch.cat([sigma, sigma]) if cfg else sigma,
        **conditioning(tr, cfg),
        "x_next": torch.stack([x.latents[t + 1] for x, t in zip(tr, ts)]),
        "sigma_next": torch.stack([x.sigmas[t + 1] for x, t in zip(tr, ts)]).float(),
        "sigma_max": torch.stack([sigma_max_of(x.sigmas) for x in tr]).float(),
        "rollout_log_prob": torch.stack([x.log_probs[t] for x, t in zip(tr, ts)]).float(),
        "advantages": torch.where(is_real, adv, torch.zeros_like(adv)),
        "real": is_real,
    }
    if cfg:
        mb["guidance_scale"] = torch.tensor([float(x.guidance_scale) for x in tr])
    if mismatch is not None:
        old, weight, keep = zip(*(mismatch[it] for it in items))
        mb["old_log_prob"] = torch.stack(old).float()
        mb["is_weight"] = torch.stack(weight).float()
        mb["is_keep"] = torch.stack(keep).bool()
    return {k: v.to(device) for k, v in mb.items()}


def microbatches_for(trajs: Sequence[Trajectory], advantages: torch.Tensor, items: Sequence[Item],
                     micro_batch_size: int, device: torch.device,
                     mismatch: dict[Item, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None, *,
                     conditioning: Conditioning) -> list[dict]:
    """This DP rank's microbatches for one optimizer step over ``items`` (all ranks pass the same list)."""
    if not items:
        return []
    mine, real = dp_slice(list(items), micro_batch_size)
    return [stack_items(trajs, advantages, mine[s:s + micro_batch_size], real[s:s + micro_batch_size], device,
                        mismatch, conditioning=conditioning) for s in range(0, len(mine), micro_batch_size)]


def num_samples(mb: dict) -> int:
    """B: the samples of a microbatch (the DiT batch is 2B with CFG)."""
    return int(mb["real"].shape[0])


def policy_input(mb: dict) -> torch.Tensor:
    """x_t ``[B, ...]`` of a microbatch (the first copy under CFG)."""
    return mb["latents"][:num_samples(mb)]


def guided_velocity(velocity: torch.Tensor, mb: dict) -> torch.Tensor:
    """The velocity the sampler stepped with: the DiT output, or v_u + g·(v_c − v_u) under CFG; with the
    family's ``cfg_renorm`` key (Qwen-Image's true CFG) each token's guided velocity is scaled back to the norm of
    its conditional one (over the last axis, the packed channels)."""
    if "guidance_scale" not in mb:
        return velocity
    uncond, cond = velocity.chunk(2)
    g = mb["guidance_scale"].to(velocity.dtype).view(-1, *([1] * (velocity.dim() - 1)))
    guided = uncond + g * (cond - uncond)
    if "cfg_renorm" in mb:
        guided = guided * (cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True).clamp_min(1e-12))
    return guided
