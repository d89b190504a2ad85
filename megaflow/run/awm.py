"""AWM as the run's algorithm: ODE rollouts of θ, advantage-weighted flow matching on the clean samples
(megaflow.trainer.awm, loss in megaflow.algo.awm), with a velocity KL to a fast EMA of θ.

Invariant: the fast EMA (a ShadowWeights, blended after every update) lives in checkpoints with its clock, so a
resumed run continues exactly. Decay schedule and engine weights: docs/algorithms/awm.md.
"""
from __future__ import annotations

import contextlib

import torch

from megaflow.algo.awm import AWMConfig, kl_ema_decay
from megaflow.config import MegaflowConfig
from megaflow.config.sections import from_section
from megaflow.rollout.types import RolloutRequest
from megaflow.run.requests import make_requests
from megaflow.seeds import MINIBATCHES, iteration_seed

EMA_KL = "awm_ema"
"""The checkpoint name of the fast EMA."""


def awm_settings(cfg: MegaflowConfig):
    """The trainer's AWM settings from ``algo`` and ``train``; ConfigError (a ValueError) for a config AWM cannot
    run."""
    from megaflow.config.algo_checks import check_awm
    from megaflow.trainer.awm import AWMSettings
    check_awm(cfg)
    a, t = cfg.algo, cfg.train
    return AWMSettings(loss=from_section(AWMConfig, a), num_timesteps=a.awm_num_timesteps,
                       timestep_fraction=a.timestep_fraction, micro_batch_size=t.micro_batch_size,
                       num_inner_epochs=t.num_inner_epochs, num_minibatches=t.num_minibatches)


class AWM:
    """The AWM algorithm of a run (megaflow.run.algorithm.Algorithm)."""

    name = "awm"

    def __init__(self, cfg: MegaflowConfig, trainer, reference=None, ema=None):
        from megaflow.trainer.shadow import ShadowWeights
        self.cfg, self.trainer, self.reference, self.ema = cfg, trainer, reference, ema
        self.settings = awm_settings(cfg)
        self.ema_kl = ShadowWeights.of(trainer.chunks)

    def requests(self, prompts, iteration: int) -> list[RolloutRequest]:
        return make_requests(self.cfg, prompts, iteration)

    def update(self, trajs, advantages: torch.Tensor, keep: torch.Tensor, iteration: int) -> dict:
        from megaflow.trainer.awm import awm_update
        g = torch.Generator().manual_seed(iteration_seed(self.cfg.run.seed, iteration, MINIBATCHES))
        lr = self.trainer.schedule_lr(iteration)
        metrics = awm_update(self.trainer, trajs, advantages, keep, self.settings, generator=g,
                             ema_kl=self.ema_kl, ref=self.reference, ema=self.ema)
        a, steps = self.cfg.algo, int(metrics.get("num_updates", 0))
        decay = kl_ema_decay(self.ema_kl.num_updates + steps, rate=a.old_decay_rate, cap=a.old_decay_max)
        self.ema_kl.blend(decay, steps)
        return {**metrics, "ema_kl_decay": decay, **lr}

    def engine_weights(self):
        """The engines sample with θ itself: nothing to put in place."""
        return contextlib.nullcontext()

    def shadows(self) -> dict:
        return {EMA_KL: self.ema_kl}
