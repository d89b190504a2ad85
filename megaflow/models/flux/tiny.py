"""Tiny FLUX.1 configs, random diffusers reference models (the ground truth) and synthetic batches."""
from __future__ import annotations

from typing import Any

import torch

from megaflow.models.common.tiny import noised, random_model, sft_reference
from megaflow.models.flux.model import image_ids


def tiny_config(*, guidance_embeds: bool = True, **overrides: Any) -> dict[str, Any]:
    """A diffusers FLUX transformer config small enough for CPU tests: hidden 32 (4 heads x 8),
    2 double-stream + 2 single-stream blocks, RoPE axes (2, 2, 4), 16-channel packed tokens."""
    cfg = dict(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=24, pooled_projection_dim=16,
        guidance_embeds=guidance_embeds, axes_dims_rope=(2, 2, 4),
    )
    cfg.update(overrides)
    return cfg


def diffusers_model(config: dict[str, Any], *, seed: int = 0):
    """A random-init diffusers FluxTransformer2DModel (fp32, eval mode) for ``config``; weights
    drawn as ``common.tiny.random_model`` says (q/k norm scales around 1)."""
    from diffusers import FluxTransformer2DModel

    # ".norm_": attn.norm_q / norm_k / norm_added_q / norm_added_k
    return random_model(FluxTransformer2DModel, config, seed=seed, is_norm_scale=lambda name: ".norm_" in name)


def sft_batches(config: dict[str, Any], *, num_microbatches: int = 2, batch: int = 2, grid: int = 4,
                context_len: int = 6, seed: int = 1) -> list[dict]:
    """Rectified-flow microbatches on packed tokens; txt_ids random small positions to exercise context RoPE."""
    g = torch.Generator().manual_seed(seed)
    n, c = grid * grid, config["in_channels"]
    out = []
    for _ in range(num_microbatches):
        b = dict(
            x0=torch.randn(batch, n, c, generator=g),
            noise=torch.randn(batch, n, c, generator=g),
            sigma=torch.rand(batch, generator=g).clamp(0.05, 0.95),
            encoder_hidden_states=torch.randn(batch, context_len, config["joint_attention_dim"], generator=g),
            pooled_projections=torch.randn(batch, config["pooled_projection_dim"], generator=g),
            txt_ids=torch.randint(0, 8, (context_len, 3), generator=g).float(),
            img_ids=image_ids(grid, grid),
        )
        if config.get("guidance_embeds"):
            b["guidance"] = 1 + 4 * torch.rand(batch, generator=g)
        out.append(b)
    return out


def diffusers_velocity(model, b: dict, latents: torch.Tensor | None = None) -> torch.Tensor:
    """The diffusers model's velocity for batch ``b`` at x_t (or at ``latents``); timestep = sigma."""
    return model(hidden_states=noised(b) if latents is None else latents, timestep=b["sigma"],
                 encoder_hidden_states=b["encoder_hidden_states"], pooled_projections=b["pooled_projections"],
                 txt_ids=b["txt_ids"], img_ids=b["img_ids"], guidance=b.get("guidance")).sample


def diffusers_sft_reference(model, batches: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """Mean rectified-flow loss over ``batches`` and its grads (diffusers names) for ``model``."""
    return sft_reference(model, batches, diffusers_velocity)


def check_latent_shape(conf: dict[str, Any], image_tokens: int) -> tuple[int, ...]:
    """One sample's packed tokens of ``image_tokens`` tokens for transformer config ``conf``, as the train-step GPU
    check draws them (``megaflow.testing.gpu.model``)."""
    return (1, image_tokens, conf["in_channels"])


def check_inputs(image_tokens: int, text_tokens: int, device) -> dict[str, torch.Tensor]:
    """The model inputs of the GPU check's microbatch beside latents, sigma and text: the text and (square) image
    positions and the embedded guidance 3.5 (the check's ``rollout.guidance_scale``)."""
    side = int(image_tokens ** 0.5)
    return dict(txt_ids=torch.zeros(text_tokens, 3, device=device), img_ids=image_ids(side, side).to(device),
                guidance=torch.full((1,), 3.5, device=device))
