"""The family's VAE trained to reconstruct ShapeEval ground truth (images, or clips for a video kit: whatever the
benchmark renders, 32 px -> latents at the family's factors), its latent statistics then set as the family
normalises latents (``kit.set_latent_stats``).
"""
from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from megaflow.pretrain.bench import ImageBench, to_pixels  # noqa: F401 (to_pixels: its old home)


def train_vae(kit, vae, prompts: list[str], *, resolution: int, steps: int, batch: int = 32, lr: float = 2e-3,
              kl_weight: float = 1e-6, seed: int = 0, log=None, bench=None) -> dict:
    """Train ``vae`` in place on ``bench``'s renders of ``prompts`` (default: image ShapeEval); set its latent
    statistics; return stats."""
    bench = bench or ImageBench()
    rng = random.Random(seed)
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    vae.train()
    loss = torch.tensor(0.0)
    for step in range(steps):
        batch_prompts = [rng.choice(prompts) for _ in range(batch)]
        x = bench.render(batch_prompts, resolution=resolution, seed=rng.randrange(2**31))
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
        x = bench.render([rng.choice(prompts) for _ in range(256)], resolution=resolution, seed=seed + 1)
        z = kit.vae_posterior(vae, x).mode()
    return {"vae_loss": float(loss.detach()), **kit.set_latent_stats(vae, z)}
