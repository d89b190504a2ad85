"""The megatron-core trainer: ``runner`` (``Trainer``, ``ReferenceModel``: model, optimizer, steps, full-weight
streaming), ``grpo`` (one FlowGRPO update over a rollout batch), ``settings`` (the one mapping from megaflow's
config to megatron's) and ``checkpoint`` (dist-checkpoint save / load with TP/PP resharding)."""
