"""SD3 MMDiT configuration: the ONE mapping from a diffusers ``transformer/config.json`` to megatron.
``MMDiTConfig`` is a megatron ``TransformerConfig`` with the SD3 fields; ``from_diffusers`` /
``to_diffusers`` map both ways.

Design notes: docs/design/models.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megaflow.models.common.config import (  # noqa: F401  (gelu_tanh: re-exported)
    DiTConfig,
    build_config,
    diffusers_config_dict,
    gelu_tanh,
    read_diffusers_config,
)

# Diffusers config keys we map; keys starting with "_" (class name, version) are metadata.
_DIFFUSERS_KEYS = (
    "sample_size", "patch_size", "in_channels", "num_layers", "attention_head_dim",
    "num_attention_heads", "joint_attention_dim", "caption_projection_dim",
    "pooled_projection_dim", "out_channels", "pos_embed_max_size", "dual_attention_layers",
    "qk_norm",
)
_DIFFUSERS_DEFAULTS = {  # SD3Transformer2DModel.__init__ defaults (diffusers 0.37)
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 18,
    "attention_head_dim": 64, "num_attention_heads": 18, "joint_attention_dim": 4096,
    "caption_projection_dim": 1152, "pooled_projection_dim": 2048, "out_channels": 16,
    "pos_embed_max_size": 96, "dual_attention_layers": (), "qk_norm": None,
}
SUPPORTED_QK_NORMS = (None, "rms_norm")


@dataclass(kw_only=True)
class MMDiTConfig(DiTConfig):
    """megatron TransformerConfig plus the SD3 MMDiT fields (built by ``from_diffusers``)."""

    sample_size: int = 128
    """Latent height/width the positional grid was trained for (diffusers ``sample_size``)."""
    pos_embed_max_size: int = 96
    """Side of the stored sin-cos position grid; inputs use a centred crop of it."""
    dual_attention_layers: tuple[int, ...] = ()
    """Blocks with a second, image-only self-attention (SD3.5-medium "MMDiT-X")."""
    qk_norm: str | None = None
    """Per-head q/k normalisation: None or "rms_norm" (SD3.5)."""
    num_train_timesteps: int = 1000
    """The DiT's timestep input is ``sigma * num_train_timesteps`` (flow-matching convention)."""

    def __post_init__(self):
        if self.qk_norm not in SUPPORTED_QK_NORMS:
            raise ValueError(f"qk_norm={self.qk_norm!r} is not supported; use one of {SUPPORTED_QK_NORMS}")
        bad = [i for i in self.dual_attention_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"dual_attention_layers {bad} outside [0, num_layers={self.num_layers})")
        super().__post_init__()


def from_diffusers(diffusers_config: dict | str | Path, **megatron_kwargs: Any) -> MMDiTConfig:
    """The MMDiT config from a diffusers SD3 config (dict or path); ``megatron_kwargs`` pass through.
    ValueError names the first unknown key or unsupported value."""
    d, extra = read_diffusers_config(diffusers_config, keys=_DIFFUSERS_KEYS, defaults=_DIFFUSERS_DEFAULTS,
                                     what="SD3 transformer config")
    hidden = d["num_attention_heads"] * d["attention_head_dim"]
    if d["caption_projection_dim"] != hidden:
        raise ValueError(
            f"caption_projection_dim={d['caption_projection_dim']} must equal "
            f"num_attention_heads*attention_head_dim={hidden} (both MMDiT streams share one width)"
        )
    if d["pos_embed_max_size"] is None:
        raise ValueError("pos_embed_max_size=None is not supported (SD3 always crops a stored grid)")
    return build_config(
        MMDiTConfig, d, extra, megatron_kwargs,
        num_layers=d["num_layers"],
        qk_layernorm=d["qk_norm"] is not None,
        sample_size=d["sample_size"],
        pos_embed_max_size=d["pos_embed_max_size"],
        dual_attention_layers=tuple(d["dual_attention_layers"]),
        qk_norm=d["qk_norm"],
    )


def to_diffusers(config: MMDiTConfig) -> dict[str, Any]:
    """The diffusers ``SD3Transformer2DModel`` config dict for ``config`` (inverse of from_diffusers)."""
    return diffusers_config_dict("SD3Transformer2DModel", config, _DIFFUSERS_KEYS, caption_projection_dim="hidden_size")
