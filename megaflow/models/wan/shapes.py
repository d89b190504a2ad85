"""Wan 2.1's video ShapeEval pipeline for ``megaflow pretrain``: a WanPipeline sized for video ShapeEval on CPU (a
whole-word UMT5 tokenizer, a small UMT5 encoder trained on the video grammar, a 2-level AutoencoderKLWan (32 px x 5
frames <-> 16 x 2 x 8 x 8: spatial factor 4, Wan's temporal factor 4), a WanTransformer3DModel with patch (1, 1, 1),
so one token covers 4 x 4 pixels as in the image kits). Invariant: the conditioning is WanPipeline's own
``encode_prompt`` at ``TEXT_LEN`` tokens (zero rows past the prompt), which SGLang's Wan pipeline computes too.
The contract every family's ``shapes`` module keeps is in ``megaflow.pretrain.kit``; ``FRAMES`` makes it a video kit.

Why spatial factor 4, not 2: AutoencoderKLWan halves time only in a level that also halves space, so Wan's temporal
compression 4 (which the card's frame checks assume: F = 4k + 1) needs two levels; the DiT's (1, 1, 1) patch keeps
the image kits' 4 x 4 pixels a token (64 tokens a latent frame at 32 px).
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from megaflow.data.shapes import shapes_vocabulary
from megaflow.data.video_shapes import DIRECTIONS
from megaflow.models.common.latent_stats import channel_stats, set_channel_stats

PIPELINE_CLASS = "WanPipeline"
FRAMES = 5  # frames of a clip: 1 + 4 (the VAE keeps the first frame, then 4 frames a latent frame)
TEMPORAL_FACTOR = 4
SPATIAL_FACTOR = 4
LATENT_CHANNELS = 16  # Wan 2.1's z_dim
TEXT_WIDTH = 64  # the UMT5 stand-in's d_model (text_dim of the DiT)
TEXT_LAYERS = 3
# Prompt length in tokens: SGLang's Wan pipeline pads every prompt's states with zero rows to 512 (fixed), and the
# DiT attends to those rows unmasked (its text projection makes them non-zero), so the kit conditions on 512 too.
TEXT_LEN = 512
VIDEO_WORDS = ("moving", "both", "turning", *DIRECTIONS)
META = {"max_sequence_length": TEXT_LEN}
"""What the pipeline declares in ``megaflow.json`` (applied per SGLang request)."""
DESCRIPTION = ("A Wan 2.1-family diffusers pipeline (WanPipeline) made offline by `megaflow pretrain`: a UMT5 stand-in "
               f"({TEXT_LAYERS} layers, {TEXT_WIDTH} wide) trained on the video grammar, a 2-level AutoencoderKLWan "
               f"trained on rendered clips ({FRAMES} frames of 32 px <-> {LATENT_CHANNELS} x 2 x 8 x 8), a Wan DiT "
               "({num_layers} blocks) trained by rectified flow through megatron-core on clips of video ShapeEval "
               f"TRAIN prompts. Prompts are padded to {TEXT_LEN} tokens (`megaflow.json`).")
"""The shipped model's description (RECIPE.md); ``{num_layers}`` is filled in."""


def latent_frames(num_frames: int = FRAMES) -> int:
    return (num_frames - 1) // TEMPORAL_FACTOR + 1


def text_components(*, seed: int):
    """(tokenizer, text_encoder), untrained: every word of the video grammar is one UMT5 piece."""
    from transformers import UMT5Config, UMT5EncoderModel

    from megaflow.models.tiny_pipeline import make_t5_tokenizer

    tok = make_t5_tokenizer(tuple(dict.fromkeys((*shapes_vocabulary(), *VIDEO_WORDS))))
    config = UMT5Config(vocab_size=len(tok), d_model=TEXT_WIDTH, d_kv=TEXT_WIDTH // 4, d_ff=2 * TEXT_WIDTH,
                        num_layers=TEXT_LAYERS, num_heads=4, relative_attention_num_buckets=8,
                        feed_forward_proj="gated-gelu", pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                        decoder_start_token_id=0)
    torch.manual_seed(seed + 2)
    return tok, UMT5EncoderModel(config).eval()


def trained_encoders(text) -> list[tuple]:
    """The (tokenizer, encoder) pairs the grammar objective trains: the one UMT5."""
    return [(text[0], text[1])]


def finish_text(text) -> None:
    """Nothing after training (the encoder is used as trained)."""


def word_positions(tokenizer, prompt: str) -> list[int]:
    """Token index of each word of ``prompt`` (UMT5 adds no start token; a trailing comma is its own piece after
    the word's); ValueError when a word is not one piece."""
    words = prompt.split()
    pieces = tokenizer.convert_ids_to_tokens(tokenizer(prompt)["input_ids"])
    starts = [i for i, p in enumerate(pieces) if p.startswith("\u2581")]
    if [pieces[i] for i in starts] != ["\u2581" + w.rstrip(",") for w in words]:
        raise ValueError(f"tokenizer does not map every word of {prompt!r} to one token")
    return starts


def text_features(encoder, tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token states [N, L, H] as the pipeline reads them (the last hidden state; padded with a mask to the
    longest prompt: a real token's state does not depend on the padding), pooled [N, H]: the mean over each
    prompt's tokens)."""
    tok = tokenizer(prompts, padding=True, return_tensors="pt")
    states = encoder(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"]).last_hidden_state
    mask = tok["attention_mask"][..., None].to(states.dtype)
    return states, (states * mask).sum(1) / mask.sum(1)


def make_vae(*, seed: int):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=16, z_dim=LATENT_CHANNELS, dim_mult=[1, 2, 2], num_res_blocks=1,
                            temperal_downsample=[True, True], latents_mean=[0.0] * LATENT_CHANNELS,
                            latents_std=[1.0] * LATENT_CHANNELS, scale_factor_spatial=SPATIAL_FACTOR,
                            scale_factor_temporal=TEMPORAL_FACTOR)


def vae_posterior(vae, pixels: torch.Tensor):
    """The VAE's latent distribution of clips [B, 3, F, H, W] in [-1, 1]."""
    return vae.encode(pixels).latent_dist


def vae_reconstruct(vae, z: torch.Tensor) -> torch.Tensor:
    return vae.decode(z).sample


def set_latent_stats(vae, z: torch.Tensor) -> dict:
    """Per-channel mean and std of latents ``z`` [B, C, f, h, w] as the VAE's ``latents_mean`` / ``latents_std``."""
    return set_channel_stats(vae, z)


@torch.no_grad()
def encode(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Clips [B, 3, F, H, W] in [-1, 1] -> normalised DiT latents [B, C, f, h, w] ((z - mean) / std, posterior
    mode), on the CPU (computed on the VAE's device)."""
    z = vae.encode(pixels.to(vae.device)).latent_dist.mode()
    mean, std = channel_stats(vae, z.device)
    return ((z - mean) / std).cpu()


@torch.no_grad()
def decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised DiT latents -> clips float [B, F, 3, H, W] in [0, 1] (as WanPipeline decodes), on the CPU."""
    z = latents.to(vae.device)
    mean, std = channel_stats(vae, z.device)
    x = vae.decode(z * std + mean).sample
    return (x / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4).cpu()


def latent_shape(num: int, resolution: int) -> tuple[int, ...]:
    side = resolution // SPATIAL_FACTOR
    return (num, LATENT_CHANNELS, latent_frames(), side, side)


def transformer_config(*, resolution: int, num_layers: int, num_heads: int, head_dim: int) -> dict:
    """The WanTransformer3DModel config of the ShapeEval DiT (patch (1, 1, 1), MLP 4x, Wan's 256 timestep
    channels, 3-D RoPE split by diffusers from the head)."""
    hidden = num_heads * head_dim
    return {"patch_size": (1, 1, 1), "num_attention_heads": num_heads, "attention_head_dim": head_dim,
            "in_channels": LATENT_CHANNELS, "out_channels": LATENT_CHANNELS, "text_dim": TEXT_WIDTH, "freq_dim": 256,
            "ffn_dim": 4 * hidden, "num_layers": num_layers, "cross_attn_norm": True,
            "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 32}


def resolution_of(config: dict) -> int | None:
    """None: the rotary DiT takes any clip size."""
    return None


def assemble(*, text, vae, transformer_config: dict, transformer_state: dict | None, seed: int = 0):
    """A WanPipeline from the parts (transformer weights from ``transformer_state`` if given); the flow-matching
    Euler scheduler at Wan 2.1's 480p shift 3."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(**transformer_config).eval()
    if transformer_state is not None:
        missing, unexpected = transformer.load_state_dict(transformer_state, strict=False)
        if missing or unexpected:
            raise ValueError(f"transformer weights do not match the config: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
    tok, enc = text
    return WanPipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000,
                                                                                         shift=3.0),
                       vae=vae, text_encoder=enc, tokenizer=tok)


def load_parts(path: Path):
    """(text components, VAE, transformer config, transformer state dict) of a saved ShapeEval pipeline."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(path, torch_dtype=torch.float32)
    tcfg = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    return (pipe.tokenizer, pipe.text_encoder), pipe.vae, tcfg, pipe.transformer.state_dict()


def after_save(directory: Path) -> None:
    """Nothing to add: both pipelines read the spatial and temporal factors from the VAE's own config."""


@torch.no_grad()
def conditioning(pipe, prompts: list[str], *, batch: int = 512) -> dict[str, torch.Tensor]:
    """The DiT's conditioning of each prompt as WanPipeline (and SGLang's Wan pipeline) computes it at
    ``TEXT_LEN``: ``encoder_hidden_states`` [N, TEXT_LEN, D], zero rows past each prompt's tokens."""
    parts = [pipe.encode_prompt(prompts[i:i + batch], do_classifier_free_guidance=False,
                                max_sequence_length=TEXT_LEN, device=torch.device("cpu"), dtype=torch.float32)[0]
             for i in range(0, len(prompts), batch)]
    return {"encoder_hidden_states": torch.cat(parts).float()}


def constant_inputs(resolution: int) -> dict[str, torch.Tensor]:
    """Model inputs shared by every sample (none for Wan: the latents carry the grid)."""
    return {}


def sample_sigmas(pipe, num_steps: int, resolution: int) -> torch.Tensor:
    """The ODE sampler's sigma grid (num_steps + 1, ending at 0) as the pipeline's scheduler sets it."""
    sched = copy.deepcopy(pipe.scheduler)
    sched.set_timesteps(num_steps)
    return sched.sigmas.float()
