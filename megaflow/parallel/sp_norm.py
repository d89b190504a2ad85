"""SP-capable torch norm: a layer-spec builder (not a patch) for megatron specs without Transformer Engine."""
from __future__ import annotations

import torch


class SPTorchNorm:
    """Torch LayerNorm/RMSNorm usable with sequence parallelism: params tagged ``sequence_parallel=True`` so their
    partial grads are all-reduced over TP. A class whose construction returns the torch norm; extra kwargs ignored."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused) -> torch.nn.Module:
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(
                f"SPTorchNorm supports LayerNorm/RMSNorm, got normalization={config.normalization!r}"
            )
        norm = kinds[config.normalization](hidden_size, eps=eps)
        if config.sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm
