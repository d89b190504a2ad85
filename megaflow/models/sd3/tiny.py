"""Tiny SD3 configs, random diffusers reference models (the ground truth) and synthetic batches."""
from __future__ import annotations

from typing import Any

import torch

from megaflow.models.common.tiny import noised, random_model, sft_reference


def tiny_config(*, qk_norm: str | None = None, dual_attention_layers: tuple[int, ...] = (),
                **overrides: Any) -> dict[str, Any]:
    """A diffusers SD3 config small enough for CPU tests (hidden 32, 4 heads, 4 blocks, 16 image tokens)."""
    cfg = dict(
        sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=24, caption_projection_dim=32,
        pooled_projection_dim=16, out_channels=4, pos_embed_max_size=12,
        dual_attention_layers=tuple(dual_attention_layers), qk_norm=qk_norm,
    )
    cfg.update(overrides)
    return cfg


def diffusers_model(config: dict[str, Any], *, seed: int = 0):
    """A random-init diffusers SD3Transformer2DModel (fp32, eval mode) for ``config``; weights
    drawn as ``common.tiny.random_model`` says (q/k norm scales around 1)."""
    from diffusers import SD3Transformer2DModel

    norm_scales = ("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight")
    return random_model(SD3Transformer2DModel, config, seed=seed, is_norm_scale=lambda name: name.endswith(norm_scales))


def sft_batches(config: dict[str, Any], *, num_microbatches: int = 2, batch: int = 2,
                context_len: int = 6, latent_size: int | None = None, seed: int = 1) -> list[dict]:
    """Rectified-flow microbatches (x0, noise, sigma, conditioning) as plain tensors."""
    g = torch.Generator().manual_seed(seed)
    size = latent_size or config["sample_size"]
    out = []
    for _ in range(num_microbatches):
        out.append(dict(
            x0=torch.randn(batch, config["in_channels"], size, size, generator=g),
            noise=torch.randn(batch, config["in_channels"], size, size, generator=g),
            sigma=torch.rand(batch, generator=g).clamp(0.05, 0.95),
            encoder_hidden_states=torch.randn(batch, context_len, config["joint_attention_dim"], generator=g),
            pooled_projections=torch.randn(batch, config["pooled_projection_dim"], generator=g),
        ))
    return out


def diffusers_velocity(model, latents, sigma, encoder_hidden_states, pooled_projections,
                       num_train_timesteps: int = 1000) -> torch.Tensor:
    """The diffusers model's velocity at timestep ``sigma * num_train_timesteps``."""
    return model(hidden_states=latents, encoder_hidden_states=encoder_hidden_states,
                 pooled_projections=pooled_projections, timestep=sigma * num_train_timesteps).sample


def diffusers_sft_reference(model, batches: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean rectified-flow loss over ``batches`` and its grads (diffusers names) for ``model``."""
    return sft_reference(model, batches, lambda m, b: diffusers_velocity(
        m, noised(b), b["sigma"], b["encoder_hidden_states"], b["pooled_projections"]))


def check_latent_shape(conf: dict[str, Any], image_tokens: int) -> tuple[int, ...]:
    """One sample's latents of ``image_tokens`` tokens for transformer config ``conf`` (a square latent image), as
    the train-step GPU check draws them (``megaflow.testing.gpu.model``)."""
    side = int(image_tokens ** 0.5) * conf["patch_size"]
    return (1, conf["in_channels"], side, side)


def check_inputs(image_tokens: int, text_tokens: int, device) -> dict[str, torch.Tensor]:
    """The model inputs of the GPU check's microbatch beside latents, sigma and text: none for SD3."""
    return {}
