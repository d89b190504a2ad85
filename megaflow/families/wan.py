"""The Wan 2.1 text-to-video card (self-attention over the video's frame / row / column tokens with 3-D RoPE,
cross-attention to UMT5 text, one shared time projection; latents [B, C, F, H, W], classifier-free guidance with a
negative prompt). Invariant: standard library only; the torch part is ``megaflow.models.wan``."""
from __future__ import annotations

from megaflow.families.card import FamilyCard


def spatial_patch(conf: dict) -> int:
    """The row / column patch of a ``WanTransformer3DModel`` config (``patch_size`` is (frames, rows, columns))."""
    patch = conf.get("patch_size") or (1, 2, 2)
    return int(patch[-1]) if isinstance(patch, (list, tuple)) else int(patch)


def plan_dims(conf: dict) -> dict:
    """``DiTDims``' Wan fields from a ``WanTransformer3DModel`` config (its defaults for missing keys): cross-attention
    blocks with their own MLP width; the frame axis is the plan's (``FamilyCard.latent_frames``)."""
    return dict(blocks=int(conf.get("num_layers", 40)), single_blocks=0, dual_blocks=0, qk_norm=True,  # always built
                in_channels=int(conf.get("in_channels", 16)), patch=spatial_patch(conf), pooled_dim=0, pos_table=0,
                context_pre_only_last=False, out_channels=int(conf.get("out_channels") or 16),
                joint_dim=int(conf.get("text_dim", 4096)), cross_attention=True, ffn=int(conf.get("ffn_dim", 13824)),
                freq_dim=int(conf.get("freq_dim", 256)), cross_norm=bool(conf.get("cross_attn_norm", True)))


# Wan-AI/Wan2.1-T2V-1.3B-Diffusers' transformer config (30 blocks, 12 heads x 128, ffn 8960) and, for a
# model.pretrained directory named as its repository, Wan-AI/Wan2.1-T2V-14B-Diffusers' (40 blocks, 40 heads x 128,
# ffn 13824); both have UMT5-XXL's encoder as text encoder (about 5.68B parameters: T5-XXL's 4.76B with a 256k
# vocabulary) and the same VAE, AutoencoderKLWan (about 127M). `megaflow plan` counts a local pipeline's own
# headers instead.
CARD = FamilyCard(
    name="wan", title="Wan", package="megaflow.models.wan", diffusers_class="WanTransformer3DModel",
    sglang_model_id="Wan2.1-T2V-1.3B-Diffusers", text_encoders=1, embedded_guidance=False,
    latent_pack=2, position_table=False, tiny_positions=32, blocks_key="num_layers",
    frames=True, temporal_compression=4, axis_positions=("rope_max_seq_len", 1024),
    builtin=("Wan 2.1 T2V 1.3B (built-in table)", dict(
        _class_name="WanTransformer3DModel", num_layers=30, attention_head_dim=128, num_attention_heads=12,
        ffn_dim=8960, text_dim=4096, freq_dim=256, in_channels=16, out_channels=16, patch_size=[1, 2, 2],
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024)),
    builtin_variants=(("Wan2.1-T2V-14B-Diffusers", "Wan 2.1 T2V 14B (built-in table)", dict(
        _class_name="WanTransformer3DModel", num_layers=40, attention_head_dim=128, num_attention_heads=40,
        ffn_dim=13824, text_dim=4096, freq_dim=256, in_channels=16, out_channels=16, patch_size=[1, 2, 2],
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=1024)),),
    encoder_params=5_680_000_000, vae_params=127_000_000, shapes_pipeline=True,
    default_text_tokens=512, fixed_text_tokens=0,  # the pipeline's max_sequence_length
    plan_dims=plan_dims,
    gpu_check_settings=("model.dtype=bfloat16", "train.micro_batch_size=1", "algo.kl_beta=0", "rollout.height=480",
                        "rollout.width=832", "rollout.guidance_scale=5.0", "parallel.tp=1"),
)
