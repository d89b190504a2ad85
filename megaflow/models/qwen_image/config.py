"""Qwen-Image configuration: the ONE mapping from a diffusers ``QwenImageTransformer2DModel`` config to
megatron. Every block is a double-stream (MMDiT) block; ``num_layers`` is diffusers' ``num_layers``.
The Edit-2511 / Layered variants (``zero_cond_t``, ``use_additional_t_cond``, ``use_layer3d_rope``) and
``guidance_embeds=True`` are refused by name.

Design notes: docs/design/models.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megaflow.models.common.config import DiTConfig, build_config, diffusers_config_dict, read_diffusers_config

_DIFFUSERS_KEYS = (
    "patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim", "num_attention_heads",
    "joint_attention_dim", "axes_dims_rope", "pooled_projection_dim",
)
_UNSUPPORTED = ("guidance_embeds", "zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")
_DIFFUSERS_DEFAULTS = {  # QwenImageTransformer2DModel.__init__ defaults (diffusers 0.37)
    "patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 3584, "axes_dims_rope": (16, 56, 56),
    "pooled_projection_dim": None, **{k: False for k in _UNSUPPORTED},
}
ROPE_THETA = 10000  # diffusers QwenEmbedRope(theta=10000)
TIMESTEP_SCALE = 1000.0  # Timesteps(scale=1000): the timestep input is sigma


@dataclass(kw_only=True)
class QwenImageConfig(DiTConfig):
    """megatron TransformerConfig plus the Qwen-Image fields (built by ``from_diffusers``)."""

    patch_size: int = 2
    """diffusers ``patch_size``: output channels per token are patch_size**2 * out_channels (the 2x2
    latent packing itself happens in the pipeline, outside the transformer)."""
    in_channels: int = 64
    """Channels of a packed latent token (hidden_states is [B, N, in_channels])."""
    joint_attention_dim: int = 3584
    """Width of the Qwen2.5-VL hidden states (input of ``context_norm`` / ``context_embed``)."""
    pooled_projection_dim: int | None = None
    """Not a QwenImageTransformer2DModel argument (Qwen-Image has no pooled text embedding), but the
    released config.json carries it (diffusers ignores it); kept only to write the config back unchanged."""
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    """RoPE channels per position axis (frame, height, width); they sum to the head dim."""

    def __post_init__(self):
        if len(self.axes_dims_rope) != 3 or sum(self.axes_dims_rope) != self.kv_channels or any(
                d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope={tuple(self.axes_dims_rope)} must be 3 even sizes summing to "
                             f"attention_head_dim={self.kv_channels}")
        super().__post_init__()


def from_diffusers(diffusers_config: dict | str | Path, **megatron_kwargs: Any) -> QwenImageConfig:
    """The Qwen-Image config from a diffusers config (dict or path); ``megatron_kwargs`` pass through.
    ValueError names the first unknown key, unsupported variant or bad value."""
    d, extra = read_diffusers_config(diffusers_config, keys=_DIFFUSERS_KEYS + _UNSUPPORTED,
                                     defaults=_DIFFUSERS_DEFAULTS,
                                     what="Qwen-Image transformer config (QwenImageTransformer2DModel)")
    on = [k for k in _UNSUPPORTED if d[k]]
    if on:
        raise ValueError(f"Qwen-Image transformer config: {on[0]}={d[on[0]]!r} is not supported (only the plain "
                         "Qwen-Image transformer: guidance_embeds, zero_cond_t, use_additional_t_cond and "
                         "use_layer3d_rope all false)")
    return build_config(QwenImageConfig, d, extra, megatron_kwargs, num_layers=d["num_layers"], qk_layernorm=True,
                        axes_dims_rope=tuple(d["axes_dims_rope"]))


def to_diffusers(config: QwenImageConfig) -> dict[str, Any]:
    """The diffusers ``QwenImageTransformer2DModel`` config dict for ``config`` (inverse of from_diffusers);
    ``pooled_projection_dim`` only when the source config had it, the refused variants written as false."""
    keys = tuple(k for k in _DIFFUSERS_KEYS if k != "pooled_projection_dim" or config.pooled_projection_dim is not None)
    return {**diffusers_config_dict("QwenImageTransformer2DModel", config, keys), **{k: False for k in _UNSUPPORTED}}
