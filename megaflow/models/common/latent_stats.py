"""Per-channel latent statistics of a Wan-style VAE (``AutoencoderKLWan``, ``AutoencoderKLQwenImage``): its config's
``latents_mean`` / ``latents_std``, which the pipelines use as z_normalised = (z - mean) / std. Invariant: one entry a
latent channel, broadcast over [B, C, F, H, W].
"""
from __future__ import annotations

import torch


def set_channel_stats(vae, z: torch.Tensor) -> dict:
    """Per-channel mean and std of latents ``z`` [B, C, F, H, W] written as the VAE's ``latents_mean`` /
    ``latents_std``; returns them."""
    mean = [float(v) for v in z.mean(dim=(0, 2, 3, 4))]
    std = [float(v) for v in z.std(dim=(0, 2, 3, 4))]
    vae.register_to_config(latents_mean=mean, latents_std=std)
    return {"latents_mean": mean, "latents_std": std}


def channel_stats(vae, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, std) of the VAE's config as [1, C, 1, 1, 1] tensors on ``device``."""
    shape = (1, len(vae.config.latents_mean), 1, 1, 1)
    return (torch.tensor(vae.config.latents_mean, device=device).view(shape),
            torch.tensor(vae.config.latents_std, device=device).view(shape))
