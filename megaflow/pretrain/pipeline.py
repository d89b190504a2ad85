"""The ShapeEval pipeline: an SD3-family diffusers pipeline sized for ShapeEval on CPU (grammar tokenizers,
2 CLIP encoders, a small VAE, an SD3 MMDiT); loads with diffusers and SGLang's native SD3 path.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

CLIP_WIDTH, T5_WIDTH = 32, 64  # SD3 pads the two concatenated CLIP widths to the T5 width: 2 * 32 <= 64
# Prompt length in tokens (every ShapeEval prompt fits: at most 9 words + start/end). SGLang pads each
# encoder's prompt to a request's ``max_sequence_length``; the DiT then attends over 2 * TEXT_LEN text
# tokens instead of 77 + 256 (4x cheaper training and sampling at 64 image tokens).
TEXT_LEN = 12


def text_components(*, seed: int):
    """(tokenizer, tokenizer_2, tokenizer_3, text_encoder, text_encoder_2, text_encoder_3), untrained."""
    from megaflow.models.tiny_pipeline import make_clip_encoder, make_clip_tokenizer, make_t5_encoder, make_t5_tokenizer
    from megaflow.pretrain.text import shapes_vocabulary

    words = shapes_vocabulary()
    tok, tok2, tok3 = make_clip_tokenizer(words), make_clip_tokenizer(words), make_t5_tokenizer(words)
    enc = make_clip_encoder(tok, hidden=CLIP_WIDTH, seed=seed + 2, with_projection=True, num_layers=3)
    enc2 = make_clip_encoder(tok2, hidden=CLIP_WIDTH, seed=seed + 3, with_projection=True, num_layers=3)
    enc3 = make_t5_encoder(tok3, d_model=T5_WIDTH, seed=seed + 4)
    return tok, tok2, tok3, enc, enc2, enc3


def transformer_config(*, resolution: int, num_layers: int, num_heads: int, head_dim: int,
                       patch_size: int = 2, latent_channels: int = 4) -> dict:
    """The SD3Transformer2DModel config of the ShapeEval DiT."""
    from megaflow.pretrain.vae import SPATIAL_FACTOR
    size = resolution // SPATIAL_FACTOR
    return dict(sample_size=size, patch_size=patch_size, in_channels=latent_channels, out_channels=latent_channels,
                num_layers=num_layers, attention_head_dim=head_dim, num_attention_heads=num_heads,
                joint_attention_dim=T5_WIDTH, caption_projection_dim=num_heads * head_dim,
                pooled_projection_dim=2 * CLIP_WIDTH, pos_embed_max_size=max(16, size // patch_size))


def assemble(*, text, vae, transformer_config: dict, transformer_state: dict | None, shift: float = 3.0, seed: int = 0):
    """A StableDiffusion3Pipeline from the parts (transformer weights from ``transformer_state`` if given)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(**transformer_config).eval()
    if transformer_state is not None:
        missing, unexpected = transformer.load_state_dict(transformer_state, strict=False)
        missing = [k for k in missing if k != "pos_embed.pos_embed"]  # a buffer in diffusers
        if missing or unexpected:
            raise ValueError(f"transformer weights do not match the config: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
    tok, tok2, tok3, enc, enc2, enc3 = text
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift),
        vae=vae, text_encoder=enc, tokenizer=tok, text_encoder_2=enc2, tokenizer_2=tok2,
        text_encoder_3=enc3, tokenizer_3=tok3)


def save_pipeline(pipe, out: Path, *, extra_files: dict[str, str] | None = None) -> Path:
    """Save atomically (write a sibling temp dir, then replace ``out``); the VAE config gets
    ``spatial_compression_ratio`` so SGLang sizes latents right."""
    from megaflow.pretrain.vae import SPATIAL_FACTOR
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    vae_cfg = tmp / "vae" / "config.json"
    cfg = json.loads(vae_cfg.read_text())
    cfg["spatial_compression_ratio"] = SPATIAL_FACTOR
    vae_cfg.write_text(json.dumps(cfg, indent=2, sort_keys=True))
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def encode_prompts(pipe, prompts: list[str], *, max_sequence_length: int = TEXT_LEN,
                   batch: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """The ShapeEval pipeline's prompts encoded as SGLang encodes them, at its ``TEXT_LEN``
    (megaflow.models.sd3.text.encode_prompts)."""
    from megaflow.models.sd3.text import encode_prompts as encode
    return encode(pipe, prompts, max_sequence_length=max_sequence_length, batch=batch)
