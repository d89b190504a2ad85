"""Rewards: score generated images (sync or async), failures masked, never fatal: ``build_multi_reward(specs)``
-> ``MultiReward.score`` -> ``RewardScores``; ``AsyncScorer``. Registry: ``REWARDS`` in ``registry.py``.
"""
from megaflow.rewards.base import Reward, safe_score, to_float, to_pil, to_uint8
from megaflow.rewards.registry import REWARDS, RewardSpec, build_multi_reward, build_reward
from megaflow.rewards.scorer import AsyncScorer, MultiReward

__all__ = [
    "REWARDS", "AsyncScorer", "MultiReward", "Reward", "RewardSpec", "build_multi_reward",
    "build_reward", "safe_score", "to_float", "to_pil", "to_uint8",
]
