"""A small AutoencoderKL trained to reconstruct ShapeEval renders (32 px -> 4x16x16 latents), with SD3-style
scaling/shift factors; the saved config carries ``spatial_compression_ratio = 2`` for SGLang.
"""
from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F

from megaflow.shapeeval.render import render_prompts

SPATIAL_FACTOR = 2


def make_shapes_vae(*, latent_channels: int = 4, seed: int = 0):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=16, sample_size=32,
        shift_factor=0.0, scaling_factor=1.0, use_quant_conv=False, use_post_quant_conv=False,
    )


def to_pixels(images_uint8: np.ndarray) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float [B, 3, H, W] in [-1, 1] (the VAE's input range)."""
    return torch.from_numpy(images_uint8).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def train_vae(vae, prompts: list[str], *, resolution: int, steps: int, batch: int = 32, lr: float = 2e-3,
              kl_weight: float = 1e-6, seed: int = 0, log=None) -> dict:
    """Train ``vae`` in place on renders of ``prompts``; set its scaling/shift factors; return stats."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    vae.train()
    loss = torch.tensor(0.0)
    for step in range(steps):
        batch_prompts = [rng.choice(prompts) for _ in range(batch)]
        x = to_pixels(render_prompts(batch_prompts, resolution=resolution, seed=rng.randrange(2**31)))
        post = vae.encode(x).latent_dist
        recon = vae.decode(post.sample()).sample
        loss = F.mse_loss(recon, x) + kl_weight * post.kl().mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        sched.step()
        if log is not None and (step + 1) % 100 == 0:
            log(f"vae step {step + 1}/{steps}: loss {float(loss):.5f}")
    vae.eval()
    with torch.no_grad():
        x = to_pixels(render_prompts([rng.choice(prompts) for _ in range(256)], resolution=resolution, seed=seed + 1))
        z = vae.encode(x).latent_dist.mode()
    shift, scale = float(z.mean()), float(1.0 / z.std())
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return {"vae_loss": float(loss), "shift_factor": shift, "scaling_factor": scale}


@torch.no_grad()
def encode(vae, images_uint8: np.ndarray) -> torch.Tensor:
    """Ground-truth images -> normalised DiT latents ((z - shift) * scale), posterior mode, on the CPU
    (computed on the VAE's device)."""
    z = vae.encode(to_pixels(images_uint8).to(vae.device)).latent_dist.mode()
    return ((z - vae.config.shift_factor) * vae.config.scaling_factor).cpu()


@torch.no_grad()
def decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised DiT latents -> images float [B, 3, H, W] in [0, 1] (as the SD3 pipeline decodes), on the
    CPU (computed on the VAE's device)."""
    x = vae.decode(latents.to(vae.device) / vae.config.scaling_factor + vae.config.shift_factor).sample
    return (x / 2 + 0.5).clamp(0, 1).cpu()
