"""Tiny Wan configs, random diffusers reference models (the ground truth) and synthetic video batches."""
from __future__ import annotations

from typing import Any

import torch

from megaflow.models.common.tiny import noised, random_model, sft_reference
from megaflow.models.wan.config import NUM_TRAIN_TIMESTEPS


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A diffusers Wan transformer config small enough for CPU tests: hidden 32 (4 heads x 8, rotary parts
    (4, 2, 2)), 2 blocks, MLP 64, 4 latent channels, text width 24, 32 timestep channels."""
    cfg = dict(
        patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=24, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, rope_max_seq_len=32,
    )
    cfg.update(overrides)
    return cfg


def diffusers_model(config: dict[str, Any], *, seed: int = 0):
    """A random-init diffusers WanTransformer3DModel (fp32, eval mode) for ``config``; weights drawn as
    ``common.tiny.random_model`` says (q/k norm and cross-attention norm scales around 1)."""
    from diffusers import WanTransformer3DModel

    scales = ("norm_q.weight", "norm_k.weight", "norm2.weight")
    return random_model(WanTransformer3DModel, config, seed=seed, is_norm_scale=lambda name: name.endswith(scales))


def sft_batches(config: dict[str, Any], *, num_microbatches: int = 2, batch: int = 2, frames: int = 3,
                height: int = 4, width: int = 6, context_len: int = 6, seed: int = 1) -> list[dict]:
    """Rectified-flow microbatches of video latents [B, C, frames, height, width] (x0, noise, sigma, text states)."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, config["in_channels"], frames, height, width)
    return [dict(x0=torch.randn(shape, generator=g), noise=torch.randn(shape, generator=g),
                 sigma=torch.rand(batch, generator=g).clamp(0.05, 0.95),
                 encoder_hidden_states=torch.randn(batch, context_len, config["text_dim"], generator=g))
            for _ in range(num_microbatches)]


def diffusers_velocity(model, b: dict, latents: torch.Tensor | None = None) -> torch.Tensor:
    """The diffusers model's velocity for batch ``b`` at x_t (or at ``latents``); timestep = sigma * 1000."""
    return model(hidden_states=noised(b) if latents is None else latents, timestep=b["sigma"] * NUM_TRAIN_TIMESTEPS,
                 encoder_hidden_states=b["encoder_hidden_states"]).sample


def diffusers_sft_reference(model, batches: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean rectified-flow loss over ``batches`` and its grads (diffusers names) for ``model``."""
    return sft_reference(model, batches, diffusers_velocity)
