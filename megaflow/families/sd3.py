"""The SD3 / SD3.5 card (MMDiT: joint blocks, SD3.5's second image attention, the last block context-pre-only).
Invariant: standard library only; the torch part is ``megaflow.models.sd3``."""
from __future__ import annotations

from megaflow.families.card import FamilyCard


def plan_dims(conf: dict) -> dict:
    """``DiTDims``' SD3 fields from an ``SD3Transformer2DModel`` config (its defaults for missing keys)."""
    return dict(blocks=int(conf.get("num_layers", 18)), single_blocks=0,
                dual_blocks=len(conf.get("dual_attention_layers") or ()), qk_norm=conf.get("qk_norm") is not None,
                in_channels=int(conf.get("in_channels", 16)), patch=int(conf.get("patch_size", 2)),
                pooled_dim=int(conf.get("pooled_projection_dim", 2048)),
                pos_table=int(conf.get("pos_embed_max_size") or 96) ** 2, context_pre_only_last=True)


# SD3.5-Medium's transformer config; CLIP-L/14 text 123.7M, OpenCLIP bigG/14 text 694.7M, T5-XXL encoder 4762M,
# the 16-channel VAE 83.7M.
CARD = FamilyCard(
    name="sd3", title="SD3", package="megaflow.models.sd3", diffusers_class="SD3Transformer2DModel",
    sglang_model_id="stable-diffusion-3-medium-diffusers", text_encoders=3, embedded_guidance=False,
    latent_pack=None, position_table=True, tiny_positions=16, blocks_key="num_layers",
    builtin=("SD3.5-Medium (built-in table)", dict(
        _class_name="SD3Transformer2DModel", num_layers=24, attention_head_dim=64, num_attention_heads=24,
        joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, in_channels=16,
        out_channels=16, patch_size=2, pos_embed_max_size=384, sample_size=128,
        dual_attention_layers=list(range(13)), qk_norm="rms_norm")),
    encoder_params=123_650_304 + 694_659_840 + 4_762_310_656, vae_params=83_653_863,
    default_text_tokens=77 + 256, fixed_text_tokens=77,  # CLIP 77 + T5 256 (SD3 pipelines)
    plan_dims=plan_dims,
    shapes_pipeline=True,
    gpu_check_settings=("model.dtype=bfloat16", "train.micro_batch_size=1", "algo.kl_beta=0", "rollout.height=512",
                        "rollout.width=512", "rollout.guidance_scale=1.0", "parallel.tp=1"),
)
