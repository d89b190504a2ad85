"""SD3's ShapeEval pipeline for ``megaflow pretrain``: a StableDiffusion3Pipeline sized for ShapeEval on CPU
(whole-word tokenizers, two CLIP stand-ins trained on the grammar, T5 switched off, a 2-level AutoencoderKL, an
SD3 MMDiT). Invariant: the conditioning here is what SGLang's SD3 pipeline computes at ``TEXT_LEN`` tokens, so
the pretrained DiT sees in RL what it saw in pretraining. The contract every family's ``shapes`` module keeps is
in ``megaflow.pretrain.kit``.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from megaflow.data.shapes import shapes_vocabulary

PIPELINE_CLASS = "StableDiffusion3Pipeline"
CLIP_WIDTH, T5_WIDTH = 32, 64  # SD3 pads the two concatenated CLIP widths to the T5 width: 2 * 32 <= 64
# Prompt length in tokens (every ShapeEval prompt fits: at most 9 words + start/end). SGLang pads each
# encoder's prompt to a request's ``max_sequence_length``; the DiT then attends over 2 * TEXT_LEN text
# tokens instead of 77 + 256 (4x cheaper training and sampling at 64 image tokens).
TEXT_LEN = 12
SPATIAL_FACTOR = 2
FRAMES = None  # an image kit
META = {"max_sequence_length": TEXT_LEN}
"""What the pipeline declares in ``megaflow.json`` (applied per SGLang request)."""
DESCRIPTION = ("An SD3-family diffusers pipeline (StableDiffusion3Pipeline) made offline by `megaflow pretrain`: "
               "grammar-trained CLIP stand-ins, T5 switched off, a 2-level VAE trained on renders (32 px <-> 4x16x16), "
               "an SD3 MMDiT ({num_layers} blocks) trained by rectified flow through megatron-core on renders of "
               f"ShapeEval TRAIN prompts. Prompts are padded to {TEXT_LEN} tokens (`megaflow.json`).")
"""The shipped model's description (RECIPE.md); ``{num_layers}`` is filled in."""


def text_components(*, seed: int):
    """(tokenizer, tokenizer_2, tokenizer_3, text_encoder, text_encoder_2, text_encoder_3), untrained."""
    from megaflow.models.tiny_pipeline import make_clip_encoder, make_clip_tokenizer, make_t5_encoder, make_t5_tokenizer

    words = shapes_vocabulary()
    tok, tok2, tok3 = make_clip_tokenizer(words), make_clip_tokenizer(words), make_t5_tokenizer(words)
    enc = make_clip_encoder(tok, hidden=CLIP_WIDTH, seed=seed + 2, with_projection=True, num_layers=3)
    enc2 = make_clip_encoder(tok2, hidden=CLIP_WIDTH, seed=seed + 3, with_projection=True, num_layers=3)
    enc3 = make_t5_encoder(tok3, d_model=T5_WIDTH, seed=seed + 4)
    return tok, tok2, tok3, enc, enc2, enc3


def trained_encoders(text) -> list[tuple]:
    """The (tokenizer, encoder) pairs the grammar objective trains: the two CLIPs."""
    return [(text[0], text[3]), (text[1], text[4])]


def finish_text(text) -> None:
    """After the CLIPs are trained: T5 returns zeros (its final RMSNorm scale 0), as SD3 does with T5 dropped."""
    with torch.no_grad():
        text[5].encoder.final_layer_norm.weight.zero_()


def word_positions(tokenizer, prompt: str) -> list[int]:
    """Token index of each word of ``prompt`` (one token a word after CLIP's start token)."""
    words = prompt.split()
    if len(tokenizer(prompt)["input_ids"]) != len(words) + 2:
        raise ValueError(f"tokenizer does not map every word of {prompt!r} to one token")
    return [i + 1 for i in range(len(words))]


def text_features(encoder, tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token states [N, L, H] as SD3 reads them (the penultimate layer), pooled [N, P] (the projection))."""
    tok = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                    return_tensors="pt")
    out = encoder(input_ids=tok["input_ids"], output_hidden_states=True)
    return out.hidden_states[-2], out.text_embeds


def make_vae(*, seed: int, latent_channels: int = 4):
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=16, sample_size=32,
        shift_factor=0.0, scaling_factor=1.0, use_quant_conv=False, use_post_quant_conv=False,
    )


def vae_posterior(vae, pixels: torch.Tensor):
    """The VAE's latent distribution of images [B, 3, H, W] in [-1, 1]."""
    return vae.encode(pixels).latent_dist


def vae_reconstruct(vae, z: torch.Tensor) -> torch.Tensor:
    return vae.decode(z).sample


def set_latent_stats(vae, z: torch.Tensor) -> dict:
    """SD3's scalar shift and scale from latents ``z`` [B, C, h, w], written into the VAE's config."""
    shift, scale = float(z.mean()), float(1.0 / z.std())
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return {"shift_factor": shift, "scaling_factor": scale}


@torch.no_grad()
def encode(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Images [B, 3, H, W] in [-1, 1] -> normalised DiT latents ((z - shift) * scale), posterior mode, on the CPU
    (computed on the VAE's device)."""
    z = vae.encode(pixels.to(vae.device)).latent_dist.mode()
    return ((z - vae.config.shift_factor) * vae.config.scaling_factor).cpu()


@torch.no_grad()
def decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised DiT latents -> images float [B, 3, H, W] in [0, 1] (as the SD3 pipeline decodes), on the CPU."""
    x = vae.decode(latents.to(vae.device) / vae.config.scaling_factor + vae.config.shift_factor).sample
    return (x / 2 + 0.5).clamp(0, 1).cpu()


def latent_shape(num: int, resolution: int) -> tuple[int, ...]:
    side = resolution // SPATIAL_FACTOR
    return (num, 4, side, side)


def transformer_config(*, resolution: int, num_layers: int, num_heads: int, head_dim: int,
                       patch_size: int = 2, latent_channels: int = 4) -> dict:
    """The SD3Transformer2DModel config of the ShapeEval DiT."""
    size = resolution // SPATIAL_FACTOR
    return dict(sample_size=size, patch_size=patch_size, in_channels=latent_channels, out_channels=latent_channels,
                num_layers=num_layers, attention_head_dim=head_dim, num_attention_heads=num_heads,
                joint_attention_dim=T5_WIDTH, caption_projection_dim=num_heads * head_dim,
                pooled_projection_dim=2 * CLIP_WIDTH, pos_embed_max_size=max(16, size // patch_size))


def resolution_of(config: dict) -> int:
    return config["sample_size"] * SPATIAL_FACTOR


def assemble(*, text, vae, transformer_config: dict, transformer_state: dict | None, seed: int = 0):
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
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=vae, text_encoder=enc, tokenizer=tok, text_encoder_2=enc2, tokenizer_2=tok2,
        text_encoder_3=enc3, tokenizer_3=tok3)


def load_parts(path: Path):
    """(text components, VAE, transformer config, transformer state dict) of a saved ShapeEval pipeline."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(path)
    text = (pipe.tokenizer, pipe.tokenizer_2, pipe.tokenizer_3, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3)
    tcfg = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    return text, pipe.vae, tcfg, pipe.transformer.state_dict()


def after_save(directory: Path) -> None:
    """The saved VAE config gets ``spatial_compression_ratio`` so SGLang sizes latents right."""
    vae_cfg = Path(directory) / "vae" / "config.json"
    cfg = json.loads(vae_cfg.read_text())
    cfg["spatial_compression_ratio"] = SPATIAL_FACTOR
    vae_cfg.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def conditioning(pipe, prompts: list[str], *, batch: int = 512) -> dict[str, torch.Tensor]:
    """The DiT's conditioning of each prompt as SGLang's SD3 pipeline computes it at ``TEXT_LEN``:
    ``encoder_hidden_states`` [N, 2 * TEXT_LEN, D], ``pooled_projections`` [N, P]."""
    from megaflow.models.sd3.text import encode_prompts
    embeds, pooled = encode_prompts(pipe, prompts, max_sequence_length=TEXT_LEN, batch=batch)
    return {"encoder_hidden_states": embeds, "pooled_projections": pooled}


def constant_inputs(resolution: int) -> dict[str, torch.Tensor]:
    """Model inputs shared by every sample (none for SD3)."""
    return {}


def sample_sigmas(pipe, num_steps: int, resolution: int) -> torch.Tensor:
    """The ODE sampler's sigma grid (num_steps + 1, ending at 0) as SGLang samples SD3 (shift 3)."""
    from megaflow.flow.schedule import sd3_sigmas
    return sd3_sigmas(num_steps, shift=3.0)
