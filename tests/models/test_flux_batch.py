"""FLUX.1 trainer microbatches from rollout trajectories (the family's ``batch_conditioning``).
Needs: CPU, 1 process, no process group. Reference: diffusers' ``FluxPipeline.prepare_latents`` (the packed
latent token count and the img_ids the pipeline builds for an image size), exact."""
from __future__ import annotations

import pytest
import torch
from diffusers import FluxPipeline

from megaflow.models.flux import from_diffusers, tiny
from megaflow.models.registry import get_family
from megaflow.rollout.types import Trajectory

FLUX = get_family("flux")


def _diffusers_packing(height: int, width: int, vae_scale_factor: int, channels: int):
    """(packed latents [1, N, 4C], img_ids [N, 3]) as FluxPipeline makes them for this image size."""
    pipe = object.__new__(FluxPipeline)
    pipe.vae_scale_factor = vae_scale_factor
    return pipe.prepare_latents(1, channels, height, width, torch.float32, torch.device("cpu"),
                                torch.Generator().manual_seed(0))


def _traj(latent: torch.Tensor, height: int | None, width: int | None, guidance: float = 3.5, index: int = 0):
    return Trajectory(request_id="r", index=index, prompt="p", seed=0, latents=latent.expand(3, -1, -1),
                      sigmas=torch.tensor([1.0, 0.5, 0.0]), log_probs=torch.zeros(2),
                      sde_mask=torch.ones(2, dtype=torch.bool), sde_type="sde", noise_level=0.7,
                      log_prob_no_const=False, guidance_scale=guidance, do_cfg=False,
                      conditioning={"encoder_hidden_states": torch.randn(7, 16) + index,
                                    "pooled_projections": torch.randn(8) + index,
                                    "guidance": torch.tensor(guidance * 1000)},
                      height=height, width=width)


@pytest.mark.parametrize("height,width,vae_scale_factor", [(32, 32, 8), (32, 48, 8), (64, 16, 8), (40, 56, 8),
                                                          (32, 48, 4), (48, 80, 16)])
def test_img_ids_equal_the_pipeline(height, width, vae_scale_factor):
    latents, ids = _diffusers_packing(height, width, vae_scale_factor, channels=4)
    config = from_diffusers(tiny.tiny_config(guidance_embeds=True))
    trajs = [_traj(latents[0], height, width, 3.5, 0), _traj(latents[0], height, width, 2.0, 1)]
    cond = FLUX.batch_conditioning(config, trajs, False)
    assert torch.equal(cond["img_ids"], ids)
    assert torch.equal(cond["txt_ids"], torch.zeros(7, 3))
    assert torch.equal(cond["guidance"], torch.tensor([3.5, 2.0]))  # the request's scale, not the engine's x1000
    assert torch.equal(cond["encoder_hidden_states"], torch.stack([t.conditioning["encoder_hidden_states"]
                                                                   for t in trajs]))
    assert cond["pooled_projections"].shape == (2, 8)


def test_schnell_has_no_guidance_and_mistakes_are_named():
    latents, _ = _diffusers_packing(32, 32, 8, channels=4)
    schnell = from_diffusers(tiny.tiny_config(guidance_embeds=False))
    assert "guidance" not in FLUX.batch_conditioning(schnell, [_traj(latents[0], 32, 32)], False)
    with pytest.raises(ValueError, match="classifier-free"):
        FLUX.batch_conditioning(schnell, [_traj(latents[0], 32, 32)], True)
    with pytest.raises(ValueError, match="image size"):
        FLUX.batch_conditioning(schnell, [_traj(latents[0], None, None)], False)
    with pytest.raises(ValueError, match="image size"):
        FLUX.batch_conditioning(schnell, [_traj(latents[0], 32, 32), _traj(latents[0], 32, 48)], False)
    with pytest.raises(ValueError, match="fit no grid"):
        FLUX.batch_conditioning(schnell, [_traj(latents[0, :3], 32, 32)], False)
    assert FLUX.embedded_guidance and not get_family("sd3").embedded_guidance
