"""Tiny Qwen-Image configs, random diffusers reference models (the ground truth) and synthetic batches
whose prompts have different lengths (padded at the end, with a mask; the padding holds noise, never zeros)."""
from __future__ import annotations

from typing import Any

import torch

from megaflow.models.common.tiny import noised, random_model, sft_reference


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A diffusers Qwen-Image transformer config small enough for CPU tests: hidden 32 (4 heads x 8),
    2 blocks, RoPE axes (2, 2, 4), 16-channel packed tokens, 2x2 patches of 4 latent channels out."""
    cfg = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=8,
               num_attention_heads=4, joint_attention_dim=24, axes_dims_rope=(2, 2, 4))
    cfg.update(overrides)
    return cfg


def diffusers_model(config: dict[str, Any], *, seed: int = 0):
    """A random-init diffusers QwenImageTransformer2DModel (fp32, eval mode) for ``config``; weights drawn
    as ``common.tiny.random_model`` says (q/k norm and txt_norm scales around 1)."""
    from diffusers import QwenImageTransformer2DModel

    return random_model(QwenImageTransformer2DModel, config, seed=seed,
                        is_norm_scale=lambda name: ".norm_" in name or name.startswith("txt_norm."))


def sft_batches(config: dict[str, Any], *, num_microbatches: int = 2, text_lengths: tuple[int, ...] = (5, 7),
                img_shape: tuple[int, int, int] = (1, 3, 4), seed: int = 1) -> list[dict]:
    """Rectified-flow microbatches on packed tokens, one sample per entry of ``text_lengths``: the text padded
    to the longest with random values and ``encoder_hidden_states_mask`` (1 real, 0 padding)."""
    g = torch.Generator().manual_seed(seed)
    n, c, longest = img_shape[0] * img_shape[1] * img_shape[2], config["in_channels"], max(text_lengths)
    batch = len(text_lengths)
    out = []
    for _ in range(num_microbatches):
        out.append(dict(
            x0=torch.randn(batch, n, c, generator=g),
            noise=torch.randn(batch, n, c, generator=g),
            sigma=torch.rand(batch, generator=g).clamp(0.05, 0.95),
            encoder_hidden_states=torch.randn(batch, longest, config["joint_attention_dim"], generator=g),
            encoder_hidden_states_mask=(torch.arange(longest)[None] < torch.tensor(text_lengths)[:, None]).long(),
            img_shapes=img_shape,
        ))
    return out


def diffusers_velocity(model, b: dict, latents: torch.Tensor | None = None) -> torch.Tensor:
    """The diffusers model's velocity for batch ``b`` at x_t (or at ``latents``); timestep = sigma."""
    x = noised(b) if latents is None else latents
    return model(hidden_states=x, timestep=b["sigma"], encoder_hidden_states=b["encoder_hidden_states"],
                 encoder_hidden_states_mask=b.get("encoder_hidden_states_mask"),
                 img_shapes=[[tuple(b["img_shapes"])]] * x.shape[0]).sample


def diffusers_sft_reference(model, batches: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean rectified-flow loss over ``batches`` and its grads (diffusers names) for ``model``."""
    return sft_reference(model, batches, diffusers_velocity)
