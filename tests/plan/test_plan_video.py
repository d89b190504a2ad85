"""``megaflow plan`` for a video family (Wan): the frame axis and the VAE's temporal compression in the token count,
the engine's decode and the microbatches, against hand computations; the shipped Wan GPU configs fit.

Needs: CPU only, standard library plan (no model is built). Hand computations: 81 frames -> (81 - 1) / 4 + 1 = 21
latent frames; 480 x 832 px / 8 (the VAE) / 2 (the patch) = 30 x 52 tokens a latent frame; exact integers.
"""
from __future__ import annotations

import json

import pytest

from megaflow.config import load_config
from megaflow.plan.memory import format_plan, plan

GIB = 2**30


@pytest.mark.parametrize("name, blocks, hidden", [("wan_1_3b_8xh200", 30, 1536), ("wan_14b_8xh200", 40, 5120)])
def test_wan_configs_count_frames_and_fit(name, blocks, hidden, capsys):
    from megaflow.cli import main

    assert main(["plan", "-c", f"configs/{name}.toml", "--gpu-mem-gb", "141"]) == 0  # the preflight passes it
    assert capsys.readouterr().out.strip().endswith("fits: yes")
    cfg = load_config(f"configs/{name}.toml")
    p = plan(cfg, gpus=8, gpu_mem_gib=141)
    assert (cfg.rollout.num_frames, cfg.rollout.height, cfg.rollout.width) == (81, 480, 832)
    assert p["latent_frames"] == 21 and p["image_tokens"] == 21 * 30 * 52 == 32760 and p["text_tokens"] == 512
    assert (p["dims"].blocks, p["dims"].hidden) == (blocks, hidden)  # the table of the model the directory names
    assert p["fits"] and all(g.total <= 141 * GIB for g in p["groups"]), format_plan(p)
    assert "81 frames -> 21 latent frames of 1560 tokens" in format_plan(p)
    # the engine's decode: one latent frame (4 frames) live at 512 bf16 units a pixel, into the fp32 clip
    pixels = cfg.rollout.max_batch_outputs * 480 * 832
    assert p["groups"][0].items["engine VAE decode"] == pixels * (4 * 512 * 2 + 81 * 3 * 4)


def test_frames_scale_the_video_items():
    """17 frames are 5 latent frames (81: 21); the microbatches' latents scale with them
    (x_t twice under CFG and x_{t+1}, fp32, 16 channels x 2 x 2 a token) and the text part does not."""
    def items(frames):
        p = plan(load_config("configs/wan_1_3b_8xh200.toml", [f"rollout.num_frames={frames}"]), gpus=8,
                 gpu_mem_gib=141)
        return p["image_tokens"], p["groups"][0].items["GRPO microbatches (1 step)"]
    (t81, mb81), (t17, mb17) = items(81), items(17)
    assert (t81, t17) == (21 * 1560, 5 * 1560)
    per_rank = 8 * 8 * 2 // 8  # prompts x group x the 2-step window, over 8 DP ranks, micro-batch 1
    assert mb81 - mb17 == per_rank * (t81 - t17) * 16 * 2 * 2 * 4 * 3


def test_plan_reads_a_local_pipelines_vae_factors(tmp_path):
    """A pipeline directory's own VAE config sets the spatial and temporal compression (scale_factor_spatial /
    scale_factor_temporal, as AutoencoderKLWan saves them), and its transformer config the dims."""
    conf = dict(_class_name="WanTransformer3DModel", num_layers=2, attention_head_dim=16, num_attention_heads=2,
                ffn_dim=64, text_dim=32, freq_dim=32, in_channels=16, out_channels=16, patch_size=[1, 2, 2])
    for sub, body in (("transformer", conf), ("vae", dict(_class_name="AutoencoderKLWan", scale_factor_spatial=16,
                                                          scale_factor_temporal=8))):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "config.json").write_text(json.dumps(body))
    cfg = load_config(None, ["model.family=wan", f"model.pretrained={tmp_path}", "rollout.num_frames=33",
                             "rollout.height=256", "rollout.width=512"])
    p = plan(cfg, gpus=1, gpu_mem_gib=80)
    assert p["latent_frames"] == 32 // 8 + 1 and p["image_tokens"] == 5 * (256 // 16 // 2) * (512 // 16 // 2)
    assert p["dims"].hidden == 32 and str(tmp_path) in p["dims"].source


def test_an_image_family_has_one_frame():
    p = plan(load_config("configs/sd3_medium_8xh100.toml"), gpus=8, gpu_mem_gib=80)
    assert p["latent_frames"] == 1 and p["frames"] == 0 and p["image_tokens"] == 1024
    assert "latent frames" not in format_plan(p)
