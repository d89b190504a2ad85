"""FLUX.1 configuration: the ONE mapping from a diffusers ``FluxTransformer2DModel`` config to megatron.
``num_layers`` counts ALL blocks: the double-stream ones first (0 .. D-1), then the single-stream
ones (D .. D+S-1), so megatron's pipeline split cuts through both kinds.

Design notes: docs/design/models.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megaflow.models.common.config import DiTConfig, build_config, diffusers_config_dict, read_diffusers_config

_DIFFUSERS_KEYS = (
    "patch_size", "in_channels", "out_channels", "num_layers", "num_single_layers",
    "attention_head_dim", "num_attention_heads", "joint_attention_dim", "pooled_projection_dim",
    "guidance_embeds", "axes_dims_rope",
)
_DIFFUSERS_DEFAULTS = {  # FluxTransformer2DModel.__init__ defaults (diffusers 0.37)
    "patch_size": 1, "in_channels": 64, "out_channels": None, "num_layers": 19, "num_single_layers": 38,
    "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
    "pooled_projection_dim": 768, "guidance_embeds": False, "axes_dims_rope": (16, 56, 56),
}
ROPE_THETA = 10000  # diffusers FluxPosEmbed(theta=10000)
TIMESTEP_SCALE = 1000.0  # FLUX's forward multiplies timestep (= sigma) and guidance by 1000


@dataclass(kw_only=True)
class FluxConfig(DiTConfig):
    """megatron TransformerConfig plus the FLUX.1 fields (built by ``from_diffusers``)."""

    patch_size: int = 1
    """diffusers ``patch_size``: output channels per token are patch_size**2 * out_channels (the
    2x2 latent packing itself happens in the pipeline, outside the transformer)."""
    in_channels: int = 64
    """Channels of a packed latent token (hidden_states is [B, N, in_channels])."""
    out_channels: int = 64
    """Latent channels out per patch (velocity prediction)."""
    pooled_projection_dim: int = 768
    """Width of the pooled CLIP embedding (input of ``text_embed``); ``joint_attention_dim`` is
    the T5 width."""
    num_double_layers: int = 19
    """Double-stream (MMDiT) blocks; they are global blocks 0 .. num_double_layers-1."""
    num_single_layers: int = 38
    """Single-stream blocks (fused attention + MLP) after the double-stream ones."""
    guidance_embeds: bool = False
    """FLUX.1-dev style guidance distillation: a guidance-scale embedding is added to temb."""
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    """RoPE channels per position axis of txt_ids / img_ids; they sum to the head dim."""

    def __post_init__(self):
        if self.num_double_layers + self.num_single_layers != self.num_layers:
            raise ValueError(f"num_layers={self.num_layers} must equal num_double_layers={self.num_double_layers}"
                             f" + num_single_layers={self.num_single_layers}")
        if sum(self.axes_dims_rope) != self.kv_channels or any(d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope={tuple(self.axes_dims_rope)} must be even and sum to "
                             f"attention_head_dim={self.kv_channels}")
        if self.ffn_hidden_size % self.num_attention_heads:
            raise ValueError(f"ffn_hidden_size={self.ffn_hidden_size} must be divisible by "
                             f"num_attention_heads={self.num_attention_heads} (single-block MLP is split per head)")
        super().__post_init__()

    @property
    def mlp_per_head(self) -> int:
        """Single-block MLP channels stored next to each head in the fused layouts (ffn / heads)."""
        return self.ffn_hidden_size // self.num_attention_heads

    def is_single(self, layer_index: int) -> bool:
        """True when global block ``layer_index`` (0-based) is a single-stream block."""
        return layer_index >= self.num_double_layers


def from_diffusers(diffusers_config: dict | str | Path, **megatron_kwargs: Any) -> FluxConfig:
    """The FLUX config from a diffusers config (dict or path); ``megatron_kwargs`` pass through.
    ValueError names the first unknown key or bad value."""
    d, extra = read_diffusers_config(diffusers_config, keys=_DIFFUSERS_KEYS, defaults=_DIFFUSERS_DEFAULTS,
                                     what="FLUX transformer config (FluxTransformer2DModel)")
    return build_config(
        FluxConfig, d, extra, megatron_kwargs,
        num_layers=d["num_layers"] + d["num_single_layers"],
        num_double_layers=d["num_layers"],
        num_single_layers=d["num_single_layers"],
        qk_layernorm=True,
        guidance_embeds=bool(d["guidance_embeds"]),
        axes_dims_rope=tuple(d["axes_dims_rope"]),
    )


def to_diffusers(config: FluxConfig) -> dict[str, Any]:
    """The diffusers ``FluxTransformer2DModel`` config dict for ``config`` (inverse of from_diffusers):
    diffusers' ``num_layers`` counts the double-stream blocks only."""
    return diffusers_config_dict("FluxTransformer2DModel", config, _DIFFUSERS_KEYS, num_layers="num_double_layers")
