"""Qwen-Image trainer microbatches from rollout trajectories (the family's ``batch_conditioning``).
Needs: CPU, 1 process, no process group. Reference: diffusers' ``QwenImagePipeline`` (the packed latent token
count of ``prepare_latents`` and the ``img_shapes`` its ``__call__`` builds for an image size), exact."""
from __future__ import annotations

import pytest
import torch
from diffusers import QwenImagePipeline

from megaflow.models.qwen_image import from_diffusers, tiny
from megaflow.models.registry import get_family
from megaflow.rollout.types import Trajectory

QWEN = get_family("qwen_image")
CONFIG = from_diffusers(tiny.tiny_config())


def _packed_latents(height: int, width: int) -> torch.Tensor:
    pipe = object.__new__(QwenImagePipeline)
    pipe.vae_scale_factor = 8
    return pipe.prepare_latents(1, 4, height, width, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))


def _traj(latent, height, width, text_len: int, index: int = 0, negative_len: int | None = None):
    cond = {"encoder_hidden_states": torch.randn(text_len, 24) + index}
    if negative_len is not None:
        cond["negative_encoder_hidden_states"] = torch.randn(negative_len, 24) - index
    return Trajectory(request_id="r", index=index, prompt="p", seed=0, latents=latent.expand(3, -1, -1),
                      sigmas=torch.tensor([1.0, 0.5, 0.0]), log_probs=torch.zeros(2),
                      sde_mask=torch.ones(2, dtype=torch.bool), sde_type="sde", noise_level=0.7,
                      log_prob_no_const=False, guidance_scale=4.0, do_cfg=negative_len is not None,
                      conditioning=cond, height=height, width=width)


@pytest.mark.parametrize("height,width", [(64, 64), (48, 80), (40, 56)])
def test_img_shapes_and_padded_text(height, width):
    latents = _packed_latents(height, width)
    trajs = [_traj(latents[0], height, width, 5, 0), _traj(latents[0], height, width, 3, 1)]
    cond = QWEN.batch_conditioning(CONFIG, trajs, False)
    assert cond["img_shapes"].tolist() == [1, height // 8 // 2, width // 8 // 2]  # QwenImagePipeline.__call__
    frames, rows, cols = cond["img_shapes"].tolist()
    assert frames * rows * cols == latents.shape[1]
    assert cond["encoder_hidden_states_mask"].tolist() == [[1] * 5, [1] * 3 + [0] * 2]
    assert torch.equal(cond["encoder_hidden_states"][1, :3], trajs[1].conditioning["encoder_hidden_states"])
    assert torch.equal(cond["encoder_hidden_states"][1, 3:], torch.zeros(2, 24))
    assert trajs[1].conditioning["encoder_hidden_states"].shape == (3, 24)  # the trajectory is not changed


def test_cfg_pads_both_branches_to_one_length_and_mistakes_are_named():
    latents = _packed_latents(32, 32)
    trajs = [_traj(latents[0], 32, 32, 4, 0, negative_len=6), _traj(latents[0], 32, 32, 2, 1, negative_len=1)]
    cond = QWEN.batch_conditioning(CONFIG, trajs, True)
    assert cond["encoder_hidden_states"].shape == (4, 6, 24)  # [negative; positive]
    assert cond["encoder_hidden_states_mask"].sum(1).tolist() == [6, 1, 4, 2]
    assert cond["cfg_renorm"].tolist() == [True, True]  # the sampler's true CFG renormalises (guided_velocity)
    assert "cfg_renorm" not in QWEN.batch_conditioning(CONFIG, trajs, False)
    with pytest.raises(ValueError, match="image size"):
        QWEN.batch_conditioning(CONFIG, [_traj(latents[0], None, None, 3)], False)
    with pytest.raises(ValueError, match="fit no grid"):
        QWEN.batch_conditioning(CONFIG, [_traj(latents[0, :3], 32, 32, 3)], False)


def test_a_host_share_pads_text_of_different_lengths_with_a_mask():
    """Prompts of different token counts travel in one share (megaflow.rollout.exchange): zero-padded to the longest
    with ``encoder_hidden_states_mask`` (a sample's own mask kept), and the trainer's microbatch built from the
    received samples equals the one built from the sent samples."""
    from megaflow.rollout.exchange import pack_share, unpack_share
    from megaflow.rollout.types import RolloutRequest

    latents = _packed_latents(32, 32)
    sent = [_traj(latents[0], 32, 32, n, i) for i, n in enumerate((5, 3, 4))]
    sent[2].conditioning["encoder_hidden_states_mask"] = torch.tensor([True, True, True, False])
    request = RolloutRequest(prompt="p", num_outputs=3, seed=0, num_steps=2, height=32, width=32)
    got, _ = unpack_share(pack_share(sent, None, 0.0), [request], host=0)
    assert [x.conditioning["encoder_hidden_states_mask"].tolist() for x in got] == [
        [True] * 5, [True] * 3 + [False] * 2, [True] * 3 + [False] * 2]
    assert torch.equal(got[1].conditioning["encoder_hidden_states"][:3], sent[1].conditioning["encoder_hidden_states"])
    want, have = (QWEN.batch_conditioning(CONFIG, trajs, False) for trajs in (sent, got))
    assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want)
