"""FlowGRPO as the run's algorithm (:class:`FlowGRPO`): its trainer settings, the steps it trains, its update.
Invariant: all of it is a pure function of the config and the iteration number (every rank computes the same).
"""
from __future__ import annotations

import contextlib

import torch

from megaflow.algo.flowgrpo import LossConfig, MismatchConfig, train_step_indices
from megaflow.config import MegaflowConfig
from megaflow.config.sections import from_section
from megaflow.flow.step import TransitionConfig
from megaflow.rollout.types import RolloutRequest
from megaflow.run.requests import make_requests, sde_window
from megaflow.seeds import MINIBATCHES, iteration_seed
from megaflow.trainer.flowgrpo import GRPOSettings


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
        from megaflow.trainer.flowgrpo import grpo_update
        lr = self.trainer.schedule_lr(iteration)
        metrics = grpo_update(self.trainer, trajs, advantages, keep,
                              train_steps(self.cfg, self.settings.transition, iteration), self.settings,
                              self.reference, seed=iteration_seed(self.cfg.run.seed, iteration, MINIBATCHES),
                              ema=self.ema)
        return {**metrics, **lr}

    def engine_weights(self):
        """The engines sample with θ itself: nothing to put in place."""
        return contextlib.nullcontext()

    def shadows(self) -> dict:
        return {}
