"""Config helpers shared by the DiT families: the megatron knobs every family fixes, reading a
diffusers ``transformer/config.json`` (unknown keys rejected) and the fields common to every family config.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (diffusers FeedForward "gelu-approximate")."""
    return F.gelu(x, approximate="tanh")


def megatron_defaults() -> dict[str, Any]:
    """Megatron knobs fixed by the DiT architectures (biased linears, GELU-tanh MLP, eps 1e-6
    norms, no dropout) or by running on CPU (CPU initialisation when no CUDA device exists)."""
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


def with_megatron_defaults(overrides: dict[str, Any]) -> dict[str, Any]:
    """``megatron_defaults`` updated with ``overrides`` (passed to ``TransformerConfig`` unchanged);
    ``pipeline_dtype`` defaults to ``params_dtype`` when PP > 1, as megatron needs."""
    kwargs = megatron_defaults()
    kwargs.update(overrides)
    if kwargs.get("pipeline_model_parallel_size", 1) > 1:
        kwargs.setdefault("pipeline_dtype", kwargs.get("params_dtype", torch.float32))
    return kwargs


def read_diffusers_config(diffusers_config: dict | str | Path, *, keys: tuple[str, ...], defaults: dict[str, Any],
                          what: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(values, extra)`` of a diffusers transformer config (dict or config.json path): every key in
    ``keys`` (else ``defaults``') and the ``_``-prefixed metadata, kept verbatim. ValueError names the
    first key that is neither metadata nor in ``keys``."""
    if not isinstance(diffusers_config, dict):
        diffusers_config = json.loads(Path(diffusers_config).read_text())
    unknown = [k for k in diffusers_config if not k.startswith("_") and k not in keys]
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} in {what}")
    values = {**defaults, **{k: v for k, v in diffusers_config.items() if not k.startswith("_")}}
    extra = {k: v for k, v in diffusers_config.items() if k.startswith("_") and k != "_use_default_values"}
    return values, extra


def shared_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The ``DiTConfig`` / ``TransformerConfig`` fields every family maps the same way from diffusers values ``d``."""
    hidden = d["num_attention_heads"] * d["attention_head_dim"]
    return dict(
        hidden_size=hidden,
        num_attention_heads=d["num_attention_heads"],
        kv_channels=d["attention_head_dim"],
        ffn_hidden_size=4 * hidden,
        patch_size=d["patch_size"],
        in_channels=d["in_channels"],
        out_channels=d["out_channels"] if d["out_channels"] is not None else d["in_channels"],
        joint_attention_dim=d["joint_attention_dim"],
        pooled_projection_dim=d["pooled_projection_dim"],
    )


def build_config(config_class: type, d: dict[str, Any], extra: dict[str, Any], megatron_kwargs: dict[str, Any],
                 **fields: Any):
    """``config_class`` from the diffusers values ``d``: the ``shared_fields``, the family's own
    ``fields``, the ``extra`` metadata and ``with_megatron_defaults(megatron_kwargs)``."""
    return config_class(**shared_fields(d), **fields, extra=extra, **with_megatron_defaults(megatron_kwargs))


def diffusers_config_dict(class_name: str, config: DiTConfig, keys: tuple[str, ...], **renames: str) -> dict[str, Any]:
    """Inverse of ``build_config``: ``_class_name``, the kept metadata, then each key of ``keys`` from
    the config field of that name (or ``renames[key]``); tuples written as lists."""
    renames = {"attention_head_dim": "kv_channels", **renames}
    values = {k: getattr(config, renames.get(k, k)) for k in keys}
    values = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    return {"_class_name": class_name, **config.extra, **values}


@dataclass(kw_only=True)
class DiTConfig(TransformerConfig):
    """megatron TransformerConfig plus the fields every DiT family has. Defaults are SD3's; a family
    redeclares a field to change its default."""

    patch_size: int = 2
    """Square patch size: output channels per token are patch_size**2 * out_channels."""
    in_channels: int = 16
    """Latent channels in (per packed token for FLUX)."""
    out_channels: int = 16
    """Latent channels out per patch (velocity prediction)."""
    joint_attention_dim: int = 4096
    """Width of the text-encoder hidden states (input of ``context_embed``)."""
    pooled_projection_dim: int = 2048
    """Width of the pooled text embedding (input of ``text_embed``)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Diffusers metadata keys (``_class_name``, ...) kept verbatim for ``to_diffusers``."""

    @property
    def head_dim(self) -> int:
        """Channels per attention head."""
        return self.kv_channels

    @property
    def patch_dim(self) -> int:
        """Output channels per token: patch_size**2 * out_channels."""
        return self.patch_size * self.patch_size * self.out_channels
