"""Rollout: SGLang diffusion engines that sample trajectories, behind one protocol.
Importing this package does not import sglang; only ``megaflow.rollout.sglang`` does.
"""
from megaflow.rollout.engine import EngineHealth, RolloutEngine
from megaflow.rollout.types import RolloutRequest, Trajectory

__all__ = ["EngineHealth", "RolloutEngine", "RolloutRequest", "Trajectory"]
