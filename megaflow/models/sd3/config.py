"""SD3 MMDiT configuration: the ONE mapping from a diffusers ``transformer/config.json`` to megatron.

``MMDiTConfig`` is a megatron ``TransformerConfig`` (so megatron's layers, schedules, optimizer and
dist-checkpointing read it directly) extended with the SD3-specific fields. ``from_diffusers``
maps a diffusers ``SD3Transformer2DModel`` config dict; ``to_diffusers`` maps back (used when
writing a diffusers ``config.json`` from a megatron checkpoint). Parallel degrees, dtypes and other
megatron knobs are passed through ``**megatron_kwargs`` unchanged.

Mapping (diffusers -> megatron):
    num_attention_heads * attention_head_dim -> hidden_size (the MMDiT width, both streams)
    attention_head_dim                       -> kv_channels
    4 * hidden_size                          -> ffn_hidden_size (FeedForward mult=4, gelu-tanh)
    qk_norm="rms_norm"                       -> qk_layernorm=True, normalization="RMSNorm"
    eps 1e-6 (all norms in the SD3 block)    -> layernorm_epsilon
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

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


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (diffusers FeedForward "gelu-approximate")."""
    return F.gelu(x, approximate="tanh")


@dataclass(kw_only=True)
class MMDiTConfig(TransformerConfig):
    """megatron TransformerConfig plus the SD3 MMDiT fields (built by ``from_diffusers``)."""

    sample_size: int = 128
    """Latent height/width the positional grid was trained for (diffusers ``sample_size``)."""
    patch_size: int = 2
    """Square patch size of the patch embedding."""
    in_channels: int = 16
    """Latent channels in."""
    out_channels: int = 16
    """Latent channels out (velocity prediction)."""
    pos_embed_max_size: int = 96
    """Side of the stored sin-cos position grid; inputs use a centred crop of it."""
    joint_attention_dim: int = 4096
    """Width of the text-encoder hidden states (input of ``context_embed``)."""
    pooled_projection_dim: int = 2048
    """Width of the pooled text embedding (input of ``text_embed``)."""
    dual_attention_layers: tuple[int, ...] = ()
    """Blocks with a second, image-only self-attention (SD3.5-medium "MMDiT-X")."""
    qk_norm: str | None = None
    """Per-head q/k normalisation: None or "rms_norm" (SD3.5)."""
    num_train_timesteps: int = 1000
    """The DiT's timestep input is ``sigma * num_train_timesteps`` (flow-matching convention)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Diffusers metadata keys (``_class_name``, ...) kept verbatim for ``to_diffusers``."""

    def __post_init__(self):
        if self.qk_norm not in SUPPORTED_QK_NORMS:
            raise ValueError(f"qk_norm={self.qk_norm!r} is not supported; use one of {SUPPORTED_QK_NORMS}")
        bad = [i for i in self.dual_attention_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"dual_attention_layers {bad} outside [0, num_layers={self.num_layers})")
        super().__post_init__()

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.kv_channels

    @property
    def patch_dim(self) -> int:
        """Output channels per token: patch_size**2 * out_channels."""
        return self.patch_size * self.patch_size * self.out_channels


def _megatron_defaults() -> dict[str, Any]:
    """Megatron knobs that are fixed by the SD3 architecture or by running on CPU."""
    return dict(
        add_bias_linear=True,
        gated_linear_unit=False,
        activation_func=gelu_tanh,
        bias_activation_fusion=False,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=not torch.cuda.is_available(),
    )


def from_diffusers(diffusers_config: dict | str | Path, **megatron_kwargs: Any) -> MMDiTConfig:
    """Build the MMDiT config from a diffusers SD3 transformer config (dict or config.json path).

    ``megatron_kwargs`` (e.g. tensor_model_parallel_size, sequence_parallel, params_dtype) pass
    through to ``TransformerConfig``; ``pipeline_dtype`` defaults to ``params_dtype`` when PP > 1.
    Raises ValueError naming the first unknown key or unsupported value.
    """
    if not isinstance(diffusers_config, dict):
        diffusers_config = json.loads(Path(diffusers_config).read_text())
    unknown = [k for k in diffusers_config if not k.startswith("_") and k not in _DIFFUSERS_KEYS]
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} in SD3 transformer config")
    d = {**_DIFFUSERS_DEFAULTS, **{k: v for k, v in diffusers_config.items() if not k.startswith("_")}}
    extra = {k: v for k, v in diffusers_config.items() if k.startswith("_") and k != "_use_default_values"}
    hidden = d["num_attention_heads"] * d["attention_head_dim"]
    if d["caption_projection_dim"] != hidden:
        raise ValueError(
            f"caption_projection_dim={d['caption_projection_dim']} must equal "
            f"num_attention_heads*attention_head_dim={hidden} (both MMDiT streams share one width)"
        )
    if d["pos_embed_max_size"] is None:
        raise ValueError("pos_embed_max_size=None is not supported (SD3 always crops a stored grid)")
    kwargs = _megatron_defaults()
    kwargs.update(megatron_kwargs)
    if kwargs.get("pipeline_model_parallel_size", 1) > 1:
        kwargs.setdefault("pipeline_dtype", kwargs.get("params_dtype", torch.float32))
    return MMDiTConfig(
        num_layers=d["num_layers"],
        hidden_size=hidden,
        num_attention_heads=d["num_attention_heads"],
        kv_channels=d["attention_head_dim"],
        ffn_hidden_size=4 * hidden,
        qk_layernorm=d["qk_norm"] is not None,
        sample_size=d["sample_size"],
        patch_size=d["patch_size"],
        in_channels=d["in_channels"],
        out_channels=d["out_channels"] if d["out_channels"] is not None else d["in_channels"],
        pos_embed_max_size=d["pos_embed_max_size"],
        joint_attention_dim=d["joint_attention_dim"],
        pooled_projection_dim=d["pooled_projection_dim"],
        dual_attention_layers=tuple(d["dual_attention_layers"]),
        qk_norm=d["qk_norm"],
        extra=extra,
        **kwargs,
    )


def to_diffusers(config: MMDiTConfig) -> dict[str, Any]:
    """The diffusers ``SD3Transformer2DModel`` config dict for ``config`` (inverse of from_diffusers)."""
    out = {"_class_name": "SD3Transformer2DModel", **config.extra}
    out.update(
        sample_size=config.sample_size,
        patch_size=config.patch_size,
        in_channels=config.in_channels,
        num_layers=config.num_layers,
        attention_head_dim=config.kv_channels,
        num_attention_heads=config.num_attention_heads,
        joint_attention_dim=config.joint_attention_dim,
        caption_projection_dim=config.hidden_size,
        pooled_projection_dim=config.pooled_projection_dim,
        out_channels=config.out_channels,
        pos_embed_max_size=config.pos_embed_max_size,
        dual_attention_layers=list(config.dual_attention_layers),
        qk_norm=config.qk_norm,
    )
    return out
