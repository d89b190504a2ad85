"""The Qwen-Image card (20B MMDiT: dual-stream blocks with 3-axis RoPE, 2x2 packed latents, one Qwen2.5-VL text
encoder, true classifier-free guidance with a negative prompt). Invariant: standard library only; the torch part is
``megaflow.models.qwen_image``."""
from __future__ import annotations

from megaflow.families.card import FamilyCard


def plan_dims(conf: dict) -> dict:
    """``DiTDims``' Qwen-Image fields from a ``QwenImageTransformer2DModel`` config (its defaults for missing keys):
    every block dual-stream, q/k RMS norm, no pooled text projection, no position table."""
    return dict(blocks=int(conf.get("num_layers", 60)), single_blocks=0, dual_blocks=0, qk_norm=True,
                in_channels=int(conf.get("in_channels", 64)), patch=int(conf.get("patch_size", 2)),
                pooled_dim=0, pos_table=0, context_pre_only_last=False,
                out_channels=int(conf.get("out_channels") or 16), joint_dim=int(conf.get("joint_attention_dim", 3584)))


# Qwen/Qwen-Image's transformer config (60 blocks, 24 heads x 128, 3584-wide text features). The text encoder is
# Qwen2.5-VL-7B-Instruct (8.29B parameters as published, vision tower included); the VAE is AutoencoderKLQwenImage
# (published size, rounded: 127M). `megaflow plan` counts a local pipeline's own headers instead.
CARD = FamilyCard(
    name="qwen_image", title="Qwen-Image", package="megaflow.models.qwen_image",
    diffusers_class="QwenImageTransformer2DModel", sglang_model_id="Qwen-Image", text_encoders=1,
    embedded_guidance=False, latent_pack=2, position_table=False, tiny_positions=None, blocks_key="num_layers",
    builtin=("Qwen-Image (built-in table)", dict(
        _class_name="QwenImageTransformer2DModel", num_layers=60, attention_head_dim=128, num_attention_heads=24,
        joint_attention_dim=3584, in_channels=64, out_channels=16, patch_size=2, guidance_embeds=False,
        axes_dims_rope=[16, 56, 56])),
    encoder_params=8_290_000_000, vae_params=127_000_000,
    default_text_tokens=512, fixed_text_tokens=0,  # the pipeline's max_sequence_length
    plan_dims=plan_dims,
    shapes_pipeline=True,
    gpu_check_settings=("model.dtype=bfloat16", "train.micro_batch_size=1", "algo.kl_beta=0", "rollout.height=512",
                        "rollout.width=512", "rollout.guidance_scale=4.0", "parallel.tp=1"),
)
