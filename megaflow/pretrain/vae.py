"""The family's VAE trained to reconstruct ShapeEval renders (32 px -> latents at the family's spatial factor),
its latent statistics then set as the family normalises latents (``kit.set_latent_stats``).
"""
from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F

from megaflow.shapeeval.render import render_prompts


def to_pixels(images_uint8: np.ndarray) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float [B, 3, H, W] in [-1, 1] (the VAE's input range)."""
    return torch.from_numpy(images_uint8).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def train_vae(kit, vae, prompts: list[str], *, resolution: int, steps: int, batch: int = 32, lr: float = 2e-3,
              kl_weight: float = 1e-6, seed: int = 0, log=None) -> dict:
    """Train ``vae`` in place on renders of ``prompts``; set its latent statistics; return stats."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    vae.train()
    loss = torch.tensor(0.0)
    for step in range(steps):
        batch_prompts = [rng.choice(prompts) for _ in range(batch)]
        x = to_pixels(render_prompts(batch_prompts, resolution=resolution, seed=rng.randrange(2**31)))
        post = kit.vae_posterior(vae, x)
        recon = kit.vae_reconstruct(vae, post.sample())
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
        z = kit.vae_posterior(vae, x).mode()
    return {"vae_loss": float(loss.detach()), **kit.set_latent_stats(vae, z)}
