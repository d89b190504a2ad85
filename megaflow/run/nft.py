"""DiffusionNFT as the run's algorithm: its trainer settings, its update, and θ_old, the shadow of θ the engines
sample with, blended toward θ after every update. Invariant: θ_old lives in checkpoints with its clock, so a
resumed run continues exactly. Details: docs/algorithms/nft.md.
"""
from __future__ import annotations

import torch

from megaflow.algo.nft import NFTConfig, old_policy_decay
from megaflow.config import MegaflowConfig
from megaflow.rollout.types import RolloutRequest
from megaflow.run.requests import make_requests
from megaflow.seeds import MINIBATCHES, iteration_seed

OLD = "nft_old"
"""The checkpoint name of θ_old."""


def nft_settings(cfg: MegaflowConfig):
    """The trainer's NFT settings from ``algo`` and ``train``; ConfigError (a ValueError) for a config NFT cannot
    run."""
    from megaflow.config.algo_checks import check_nft
    from megaflow.trainer.nft import NFTSettings
    check_nft(cfg)
    a, t = cfg.algo, cfg.train
    loss = NFTConfig(nft_beta=a.nft_beta, adv_clip=a.adv_clip, kl_beta=a.kl_beta)
    return NFTSettings(loss=loss, num_timesteps=a.nft_num_timesteps, micro_batch_size=t.micro_batch_size,
                       num_inner_epochs=t.num_inner_epochs, num_minibatches=t.num_minibatches)


class DiffusionNFT:
    """The DiffusionNFT algorithm of a run (megaflow.run.algorithm.Algorithm)."""

    name = "nft"

    def __init__(self, cfg: MegaflowConfig, trainer, reference=None, ema=None):
        from megaflow.trainer.shadow import ShadowWeights
        self.cfg, self.trainer, self.reference, self.ema = cfg, trainer, reference, ema
        self.settings = nft_settings(cfg)
        self.old = ShadowWeights.of(trainer.chunks)

    def requests(self, prompts, iteration: int) -> list[RolloutRequest]:
        return make_requests(self.cfg, prompts, iteration)

    def update(self, trajs, advantages: torch.Tensor, keep: torch.Tensor, iteration: int) -> dict:
        from megaflow.trainer.nft import nft_update
        g = torch.Generator().manual_seed(iteration_seed(self.cfg.run.seed, iteration, MINIBATCHES))
        lr = self.trainer.schedule_lr(iteration)
        metrics = nft_update(self.trainer, trajs, advantages, keep, self.settings, generator=g, old=self.old,
                             ref=self.reference, ema=self.ema)
        a, steps = self.cfg.algo, int(metrics.get("num_updates", 0))
        decay = old_policy_decay(self.old.num_updates + steps, rate=a.old_decay_rate, max_decay=a.old_decay_max,
                                 flat_steps=a.old_decay_flat_steps)
        self.old.blend(decay, steps)
        return {**metrics, "old_decay": decay, **lr}

    def engine_weights(self):
        """The engines sample with θ_old."""
        return self.old.applied()

    def shadows(self) -> dict:
        return {OLD: self.old}
