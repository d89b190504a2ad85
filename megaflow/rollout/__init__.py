"""Rollout: SGLang diffusion engines that sample trajectories (``Sampler``) and take weights (``WeightTarget``).
Importing this package does not import sglang; only ``megaflow.rollout.sglang`` does.
"""
from megaflow.rollout.engine import EngineHealth, RolloutEngine, Sampler
from megaflow.rollout.types import RolloutRequest, Trajectory

__all__ = ["EngineHealth", "RolloutEngine", "RolloutRequest", "Sampler", "Trajectory"]
