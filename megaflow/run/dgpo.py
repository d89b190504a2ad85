"""DGPO as the run's algorithm: ODE rollouts of θ, a group-level DPO on the clean samples (megaflow.trainer.dgpo,
loss in megaflow.algo.dgpo) against a fast EMA of θ as the preference reference.

Invariant: the fast EMA (a ShadowWeights, blended after every optimizer step) lives in checkpoints with its clock,
so a resumed run continues exactly. Decay schedule and engine weights: docs/algorithms/dgpo.md.
"""
from __future__ import annotations

import contextlib

import torch

from megaflow.algo.dgpo import DGPOConfig, ema_ref_decay
from megaflow.config import MegaflowConfig
from megaflow.config.sections import from_section
from megaflow.rollout.types import RolloutRequest
from megaflow.run.requests import make_requests
from megaflow.seeds import MINIBATCHES, iteration_seed

EMA_REF = "dgpo_ema_ref"
"""The checkpoint name of the fast EMA reference."""


def dgpo_settings(cfg: MegaflowConfig):
    """The trainer's DGPO settings from ``algo``, ``rollout`` and ``train``; ConfigError (a ValueError) for a
    config DGPO cannot run."""
    from megaflow.config.algo_checks import check_dgpo
    from megaflow.trainer.dgpo import DGPOSettings
    check_dgpo(cfg)
    a = cfg.algo
    return DGPOSettings(loss=from_section(DGPOConfig, a), group_size=cfg.rollout.group_size,
                        num_timesteps=a.dgpo_num_timesteps, trunc_steps=a.dgpo_trunc_steps,
                        micro_batch_size=cfg.train.micro_batch_size)


class DGPO:
    """The DGPO algorithm of a run (megaflow.run.algorithm.Algorithm)."""

    name = "dgpo"

    def __init__(self, cfg: MegaflowConfig, trainer, reference=None, ema=None):
        from megaflow.trainer.shadow import ShadowWeights
        self.cfg, self.trainer, self.reference, self.ema = cfg, trainer, reference, ema
        self.settings = dgpo_settings(cfg)
        self.ema_ref = ShadowWeights.of(trainer.chunks)

    def requests(self, prompts, iteration: int) -> list[RolloutRequest]:
        return make_requests(self.cfg, prompts, iteration)

    def update(self, trajs, advantages: torch.Tensor, keep: torch.Tensor, iteration: int) -> dict:
        from megaflow.trainer.dgpo import dgpo_update
        g = torch.Generator().manual_seed(iteration_seed(self.cfg.run.seed, iteration, MINIBATCHES))
        lr = self.trainer.schedule_lr(iteration)
        metrics = dgpo_update(self.trainer, trajs, advantages, keep, self.settings, generator=g,
                              ema_ref=self.ema_ref, ref=self.reference, ema=self.ema)
        a, steps = self.cfg.algo, int(metrics.get("num_updates", 0))
        decay = ema_ref_decay(self.ema_ref.num_updates + steps, rate=a.old_decay_rate, cap=a.old_decay_max)
        self.ema_ref.blend(decay, steps)
        return {**metrics, "ema_ref_decay": decay, **lr}

    def engine_weights(self):
        """The engines sample with θ itself: nothing to put in place."""
        return contextlib.nullcontext()

    def shadows(self) -> dict:
        return {EMA_REF: self.ema_ref}
