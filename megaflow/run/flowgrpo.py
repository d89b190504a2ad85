"""FlowGRPO as the run's algorithm (:class:`FlowGRPO`), on pure functions of the config and the iteration
number: what to sample (the rollout requests: seeds, SDE window, CFG), the advantages of a scored batch, the
steps to train and the trainer's settings. Every rank computes the same from the same config, so none of it
needs communication. The requests and the advantages serve every algorithm (megaflow.run.nft samples with
the same requests, ODE); the trainer's side of an update is megaflow.trainer.grpo.
"""
from __future__ import annotations

import contextlib

import torch

from megaflow.algo.advantages import AdvantageConfig, group_advantages
from megaflow.algo.loss import LossConfig, MismatchConfig, train_step_indices
from megaflow.config import MegaflowConfig
from megaflow.config.sections import from_section
from megaflow.data.prompts import prompt_and_metadata
from megaflow.flow.step import TransitionConfig
from megaflow.flow.window import check_sde_window, sample_sde_window
from megaflow.models.registry import get_family
from megaflow.rollout.types import RewardScores, RolloutRequest
from megaflow.seeds import MINIBATCHES, ROLLOUT, SDE_WINDOW, iteration_seed
from megaflow.trainer.grpo import GRPOSettings


def sde_window(cfg: MegaflowConfig, iteration: int) -> list[int] | None:
    """The SDE steps of this iteration's rollouts (None = all): ``rollout.sde_window`` as given, or with
    ``rollout.sde_window_size > 0`` a window drawn anew every iteration (FlowGRPO-Fast) from a generator
    seeded by run.seed and the iteration, so every rank computes the same one without communication."""
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
    do_cfg = r.guidance_scale > 1.0 and not get_family(cfg.model.family).embedded_guidance
    items = [prompt_and_metadata(next(prompts)) for _ in range(r.prompts_per_iter)]
    return [RolloutRequest(prompt=text, metadata=meta, num_outputs=r.group_size, seed=base + g * r.group_size,
                           num_steps=r.num_steps, height=r.height, width=r.width,
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


def grpo_settings(cfg: MegaflowConfig) -> GRPOSettings:
    """Trainer settings; also checks the SDE window and trained steps (ValueError before any training)."""
    r, a = cfg.rollout, cfg.algo
    transition = TransitionConfig(kind=r.sde_type, noise_level=r.noise_level, no_const=r.log_prob_no_const)
    train_steps(cfg, transition, 1)
    mismatch = None if a.mismatch == "none" else from_section(MismatchConfig, a)
    windowed = bool(r.sde_window) or r.sde_window_size > 0
    clip_range = a.clip_range or LossConfig.auto_clip_range(r.sde_type, windowed=windowed)  # 0 = auto
    loss = from_section(LossConfig, a, clip_range=clip_range)
    return from_section(GRPOSettings, cfg.train, transition=transition, loss=loss, mismatch=mismatch)


def train_steps(cfg: MegaflowConfig, transition: TransitionConfig, iteration: int) -> list[int]:
    """The denoising steps trained in ``iteration`` (its SDE window, or the first timestep_fraction)."""
    return train_step_indices(cfg.rollout.num_steps, transition, sde_window(cfg, iteration),
                              timestep_fraction=cfg.algo.timestep_fraction)


class FlowGRPO:
    """The FlowGRPO algorithm of a run (megaflow.run.algorithm.Algorithm): SDE rollouts of θ with per-step
    log-probs, PPO-clip steps on the trainer's recomputed log-probs; the engines hold θ."""

    name = "flowgrpo"

    def __init__(self, cfg: MegaflowConfig, trainer, reference=None, ema=None):
        self.cfg, self.trainer, self.reference, self.ema = cfg, trainer, reference, ema
        self.settings = grpo_settings(cfg)

    def requests(self, prompts, iteration: int) -> list[RolloutRequest]:
        return make_requests(self.cfg, prompts, iteration)

    def update(self, trajs, advantages: torch.Tensor, keep: torch.Tensor, iteration: int) -> dict:
        from megaflow.trainer.grpo import grpo_update
        return grpo_update(self.trainer, trajs, advantages, keep,
                           train_steps(self.cfg, self.settings.transition, iteration), self.settings, self.reference,
                           seed=iteration_seed(self.cfg.run.seed, iteration, MINIBATCHES), ema=self.ema)

    def engine_weights(self):
        """The engines sample with θ itself: nothing to put in place."""
        return contextlib.nullcontext()

    def shadows(self) -> dict:
        return {}
