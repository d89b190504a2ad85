"""The FLUX.1 card (dev / schnell: double-stream then single-stream blocks, 2x2 packed latents, embedded guidance).
Invariant: standard library only; the torch part is ``megaflow.models.flux``."""
from __future__ import annotations

from megaflow.families.card import FamilyCard


def plan_dims(conf: dict) -> dict:
    """``DiTDims``' FLUX fields from a ``FluxTransformer2DModel`` config (its defaults for missing keys)."""
    return dict(blocks=int(conf.get("num_layers", 19)), single_blocks=int(conf.get("num_single_layers", 38)),
                dual_blocks=0, qk_norm=True, in_channels=int(conf.get("in_channels", 64)),
                patch=int(conf.get("patch_size", 1)), pooled_dim=int(conf.get("pooled_projection_dim", 768)),
                pos_table=0, context_pre_only_last=False)


# FLUX.1-dev's transformer config; CLIP-L/14 text 123.1M, T5-XXL encoder 4762M, the 16-channel VAE 83.8M.
CARD = FamilyCard(
    name="flux", title="FLUX", package="megaflow.models.flux", diffusers_class="FluxTransformer2DModel",
    sglang_model_id="FLUX.1-dev", text_encoders=2, embedded_guidance=True,
    latent_pack=2, position_table=False, tiny_positions=None, blocks_key=None,
    builtin=("FLUX.1-dev (built-in table)", dict(
        _class_name="FluxTransformer2DModel", num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, in_channels=64,
        patch_size=1, guidance_embeds=True, axes_dims_rope=[16, 56, 56])),
    encoder_params=123_060_480 + 4_762_310_656, vae_params=83_819_683,
    default_text_tokens=512, fixed_text_tokens=0,  # T5 512 (FLUX.1-dev); CLIP gives only the pooled vector
    plan_dims=plan_dims,
    gpu_check_settings=("model.dtype=bfloat16", "train.micro_batch_size=1", "algo.kl_beta=0", "rollout.height=512",
                        "rollout.width=512", "rollout.guidance_scale=3.5", "parallel.tp=1", "lora.rank=32"),
)
