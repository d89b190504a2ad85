"""The algorithm seam of the loop: what to sample, how to update, what the engines hold.

The loop asks the run's :class:`Algorithm` (``algo.name``) for the iteration's requests and hands it the scored
batch. Adding one: docs/architecture.md, "An algorithm, in three files".
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import torch

from megaflow.config import MegaflowConfig
from megaflow.rollout.types import RolloutRequest


class Algorithm(Protocol):
    name: str

    def requests(self, prompts, iteration: int) -> list[RolloutRequest]:
        """This iteration's rollout requests (the same on every rank)."""

    def update(self, trajs, advantages: torch.Tensor, keep: torch.Tensor, iteration: int) -> dict:
        """Every optimizer step of this iteration on the scored batch, at the trainer's learning rate of
        ``iteration`` (``Trainer.schedule_lr``, set first); the training metrics, ``lr`` among them."""

    def engine_weights(self) -> AbstractContextManager:
        """Inside it, the trainer's live weights are the ones the engines must sample with."""

    def shadows(self) -> dict:
        """Name -> ShadowWeights the algorithm owns (checkpointed beside the model)."""


def build_algorithm(cfg: MegaflowConfig, trainer, reference=None, ema=None) -> Algorithm:
    """The algorithm of ``algo.name`` on ``trainer`` (``ema``: megaflow.trainer.shadow.EMA stepped after every
    optimizer step, or None)."""
    from megaflow.run.awm import AWM
    from megaflow.run.dgpo import DGPO
    from megaflow.run.flowgrpo import FlowGRPO
    from megaflow.run.nft import DiffusionNFT
    algorithms = {"flowgrpo": FlowGRPO, "nft": DiffusionNFT, "awm": AWM, "dgpo": DGPO}
    return algorithms[cfg.algo.name](cfg, trainer, reference, ema)
