"""Wan (2.1 / 2.2 text-to-video) configuration: the ONE mapping from a diffusers ``WanTransformer3DModel``
config to megatron. Latents are video, [B, C, F, H, W]; ``patch_size`` is (frames, rows, columns) and the
head dim splits into (time, height, width) rotary parts as diffusers' ``WanRotaryPosEmbed`` does.

Design notes: docs/design/models.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron.core.transformer.transformer_config import TransformerConfig

from megaflow.models.common.config import diffusers_config_dict, read_diffusers_config, with_megatron_defaults

_DIFFUSERS_KEYS = (
    "patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
    "freq_dim", "ffn_dim", "num_layers", "cross_attn_norm", "qk_norm", "eps", "image_dim", "added_kv_proj_dim",
    "rope_max_seq_len", "pos_embed_seq_len",
)
_DIFFUSERS_DEFAULTS = {  # WanTransformer3DModel.__init__ defaults (diffusers 0.37)
    "patch_size": (1, 2, 2), "num_attention_heads": 40, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 13824, "num_layers": 40,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "image_dim": None,
    "added_kv_proj_dim": None, "rope_max_seq_len": 1024, "pos_embed_seq_len": None,
}
_IMAGE_KEYS = ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len")  # image-to-video only: must be None
QK_NORM = "rms_norm_across_heads"  # the only q/k norm diffusers builds: RMSNorm over all heads' channels
ROPE_THETA = 10000.0  # diffusers WanRotaryPosEmbed(theta=10000)
NUM_TRAIN_TIMESTEPS = 1000  # the DiT's timestep input is sigma * 1000 (WanPipeline's flow-matching scheduler)


@dataclass(kw_only=True)
class WanConfig(TransformerConfig):
    """megatron TransformerConfig plus the Wan fields (built by ``from_diffusers``); ``ffn_hidden_size`` is
    diffusers' ``ffn_dim`` and ``layernorm_epsilon`` its ``eps``."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    """Patch (frames, rows, columns) of the Conv3d patch embedding."""
    in_channels: int = 16
    """Latent channels in."""
    out_channels: int = 16
    """Latent channels out (velocity prediction)."""
    text_dim: int = 4096
    """Width of the text-encoder (UMT5) hidden states, input of the text projection."""
    freq_dim: int = 256
    """Channels of the sinusoidal timestep features."""
    cross_attn_norm: bool = True
    """A LayerNorm with scale and bias before each block's cross-attention (else none)."""
    qk_norm: str = QK_NORM
    """diffusers ``qk_norm``; always the RMSNorm over all heads' channels of q and k."""
    rope_max_seq_len: int = 1024
    """Positions per axis the rotary tables cover: a latent grid's frames, rows and columns (after patching)
    must each be below it."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Diffusers metadata keys (``_class_name``, ...) kept verbatim for ``to_diffusers``."""

    def __post_init__(self):
        self.patch_size = tuple(self.patch_size)
        if len(self.patch_size) != 3 or any(type(p) is not int or p < 1 for p in self.patch_size):
            raise ValueError(f"patch_size={self.patch_size} must be three positive ints (frames, rows, columns)")
        if self.qk_norm != QK_NORM:
            raise ValueError(f"qk_norm={self.qk_norm!r} is not supported; Wan's transformer uses {QK_NORM!r}")
        if self.qk_layernorm:
            raise ValueError("qk_layernorm=True is not supported for Wan: its q/k norm scales are split over TP by "
                             "heads, and megatron would sum their grads over TP as if they were replicated")
        if self.kv_channels % 2 or min(self.rope_axes) < 2:
            raise ValueError(f"attention_head_dim={self.kv_channels} must be even and at least 6 (its rotary parts "
                             f"time/height/width {self.rope_axes} must each be >= 2)")
        super().__post_init__()

    @property
    def rope_axes(self) -> tuple[int, int, int]:
        """Rotary channels of (time, height, width): height = width = 2 * (head_dim // 6), time the rest."""
        hw = 2 * (self.kv_channels // 6)
        return self.kv_channels - 2 * hw, hw, hw

    @property
    def patch_dim(self) -> int:
        """Output channels per token: prod(patch_size) * out_channels."""
        return math.prod(self.patch_size) * self.out_channels


def from_diffusers(diffusers_config: dict | str | Path, **megatron_kwargs: Any) -> WanConfig:
    """The Wan config from a diffusers config (dict or path); ``megatron_kwargs`` pass through.
    ValueError names the first unknown key or unsupported value (image-to-video models are refused)."""
    d, extra = read_diffusers_config(diffusers_config, keys=_DIFFUSERS_KEYS, defaults=_DIFFUSERS_DEFAULTS,
                                     what="Wan transformer config (WanTransformer3DModel)")
    image = [k for k in _IMAGE_KEYS if d[k] is not None]
    if image:
        raise ValueError(f"{image[0]}={d[image[0]]!r}: only text-to-video Wan transformers are supported "
                         "(no image embedder)")
    hidden = d["num_attention_heads"] * d["attention_head_dim"]
    kwargs = with_megatron_defaults({"layernorm_epsilon": float(d["eps"]), **megatron_kwargs})
    return WanConfig(
        hidden_size=hidden, num_attention_heads=d["num_attention_heads"], kv_channels=d["attention_head_dim"],
        ffn_hidden_size=d["ffn_dim"], num_layers=d["num_layers"], patch_size=tuple(d["patch_size"]),
        in_channels=d["in_channels"], out_channels=d["out_channels"] or d["in_channels"], text_dim=d["text_dim"],
        freq_dim=d["freq_dim"], cross_attn_norm=bool(d["cross_attn_norm"]), qk_norm=d["qk_norm"],
        rope_max_seq_len=d["rope_max_seq_len"], extra=extra, **kwargs,
    )


def to_diffusers(config: WanConfig) -> dict[str, Any]:
    """The diffusers ``WanTransformer3DModel`` config dict for ``config`` (inverse of from_diffusers)."""
    keys = tuple(k for k in _DIFFUSERS_KEYS if k not in _IMAGE_KEYS)
    out = diffusers_config_dict("WanTransformer3DModel", config, keys, ffn_dim="ffn_hidden_size",
                                eps="layernorm_epsilon")
    return {**out, **{k: None for k in _IMAGE_KEYS}}
