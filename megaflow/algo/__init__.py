"""FlowGRPO: group-normalised advantages and the clipped policy loss with KL and mismatch correction."""
from megaflow.algo.advantages import AdvantageConfig, Advantages, contiguous_group_ids, group_advantages
from megaflow.algo.loss import (
    LossConfig,
    MismatchConfig,
    MismatchWeights,
    flow_grpo_loss,
    gaussian_kl,
    mismatch_weights,
    ppo_clip_loss,
    train_step_indices,
)

__all__ = [
    "AdvantageConfig", "Advantages", "contiguous_group_ids", "group_advantages",
    "LossConfig", "MismatchConfig", "MismatchWeights", "flow_grpo_loss", "gaussian_kl",
    "mismatch_weights", "ppo_clip_loss", "train_step_indices",
]
