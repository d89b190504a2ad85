"""Every algorithm's rollout requests of an iteration (seeds, SDE window, CFG) and group-normalised advantages.
Invariant: both are pure functions of the config and the iteration, so every rank computes the same.
"""
from __future__ import annotations

import torch

from megaflow.algo.advantages import AdvantageConfig, group_advantages
from megaflow.config import MegaflowConfig
from megaflow.config.sections import from_section
from megaflow.data.prompts import prompt_and_metadata
from megaflow.families import card
from megaflow.flow.window import check_sde_window, sample_sde_window
from megaflow.rollout.types import RewardScores, RolloutRequest
from megaflow.seeds import ROLLOUT, SDE_WINDOW, iteration_seed


def sde_window(cfg: MegaflowConfig, iteration: int) -> list[int] | None:
    """The SDE steps of this iteration's rollouts (None = all): ``rollout.sde_window``, or a window drawn per
    iteration (``sde_window_size > 0``) from run.seed and the iteration."""
    r = cfg.rollout
    window_range = check_sde_window(num_steps=r.num_steps, window=r.sde_window, window_size=r.sde_window_size,
                                    window_range=r.sde_window_range, sde_type=r.sde_type)
    if window_range is None:
        return list(r.sde_window) or None
    g = torch.Generator().manual_seed(iteration_seed(cfg.run.seed, iteration, SDE_WINDOW))
    return sample_sde_window(r.num_steps, r.sde_window_size, window_range=window_range, generator=g)


def make_requests(cfg: MegaflowConfig, prompts, iteration: int) -> list[RolloutRequest]:
    """This iteration's rollout requests; ``rollout.guidance_scale > 1`` turns on CFG unless the model
    family embeds guidance (FLUX.1-dev: the scale is a model input, one branch)."""
    r = cfg.rollout
    base = iteration_seed(cfg.run.seed, iteration, ROLLOUT)
    window = sde_window(cfg, iteration)
    do_cfg = card(cfg.model.family).uses_cfg(r.guidance_scale)
    items = [prompt_and_metadata(next(prompts)) for _ in range(r.prompts_per_iter)]
    return [RolloutRequest(prompt=text, metadata=meta, num_outputs=r.group_size, seed=base + g * r.group_size,
                           num_steps=r.num_steps, height=r.height, width=r.width,
                           num_frames=r.num_frames or None, fps=r.fps if r.num_frames else None,
                           guidance_scale=r.guidance_scale, do_cfg=do_cfg,
                           sde_type=r.sde_type, noise_level=r.noise_level,
                           sde_step_indices=window, log_prob_no_const=r.log_prob_no_const,
                           max_sequence_length=r.max_sequence_length or None,
                           request_id=f"it{iteration}-g{g}")  # the same on every rank
            for g, (text, meta) in enumerate(items)]


def generate_and_score(rollout, scorer, requests, cfg: MegaflowConfig):
    """Sample every group on ``rollout`` (one host's engines), score the images (scoring overlaps sampling,
    :func:`megaflow.rollout.hosted.sample_and_score`), turn rewards into advantages (:func:`batch_advantages`)."""
    from megaflow.rollout.hosted import sample_and_score
    return batch_advantages(*sample_and_score(rollout, scorer, requests), cfg)


def batch_advantages(trajs, scores: RewardScores, timings: dict, cfg: MegaflowConfig):
    """(trajectories, group-normalised advantages, kept mask, metrics) of a scored batch (groups of
    ``rollout.group_size`` consecutive samples); deterministic, so every rank computes the same."""
    group_ids = torch.tensor([i // cfg.rollout.group_size for i in range(len(trajs))])
    adv = group_advantages(scores.total, group_ids, from_section(AdvantageConfig, cfg.algo))
    metrics = {**scores.summary(), **{f"adv/{k}": v for k, v in adv.stats.items()},
               "adv/dropped_ratio": adv.dropped_ratio, **timings}
    return trajs, adv.advantages, adv.keep, metrics
