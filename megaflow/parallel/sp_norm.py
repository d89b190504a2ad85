"""SP-capable torch norm: a layer-spec builder (not a patch) for megatron specs without Transformer Engine."""
from __future__ import annotations

import torch


class SPTorchNorm:
    """Torch LayerNorm/RMSNorm usable with sequence parallelism (megatron's WrappedTorchNorm refuses SP).

    With ``config.sequence_parallel`` each rank normalises its own sequence slice with replicated
    weights, so their grads are partial sums: the params are tagged ``sequence_parallel=True`` and
    ``finalize_model_grads`` all-reduces them over the TP group. A class (constructing it returns
    the torch norm) because megatron's ``build_module`` returns plain functions uncalled. Use it
    wherever a spec takes a norm: input_layernorm, pre_mlp_layernorm, TransformerBlock's layer_norm.
    Extra spec kwargs (persist_layer_norm, ...) are accepted and ignored.
    """

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
