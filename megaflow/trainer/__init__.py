"""megatron-core trainer: ``engine`` (model, optimizer, steps, full-weight streaming) and
``checkpoint`` (dist-checkpoint save / load with TP/PP resharding)."""
