"""Qwen-Image's ShapeEval pipeline for ``megaflow pretrain``: a QwenImagePipeline sized for ShapeEval on CPU (a
whole-word Qwen2 tokenizer, a small Qwen2.5-VL trained on the grammar, a 1-level AutoencoderKLQwenImage (32 px <->
4 x 16 x 16, 2x2 packed: 64 tokens), a Qwen-Image MMDiT). Invariant: the conditioning is the pipeline's own
(the prompt template, its first 34 tokens dropped, padded with a mask), which SGLang's Qwen-Image pipeline computes
too. The contract every family's ``shapes`` module keeps is in ``megaflow.pretrain.kit``.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from megaflow.data.shapes import shapes_vocabulary
from megaflow.models.common.latent_stats import channel_stats, set_channel_stats

PIPELINE_CLASS = "QwenImagePipeline"
TEXT_WIDTH = 64  # the Qwen2.5-VL stand-in's hidden size (joint_attention_dim of the DiT)
TEXT_LAYERS = 3
LATENT_CHANNELS = 4
SPATIAL_FACTOR = 2  # one spatial downsampling level (2 ** len(temperal_downsample), as both pipelines read it)
FRAMES = None  # an image kit
META: dict = {}
"""Nothing to declare in ``megaflow.json``: prompts are padded to the batch's longest, with a mask."""
DESCRIPTION = ("A Qwen-Image-family diffusers pipeline (QwenImagePipeline) made offline by `megaflow pretrain`: a "
               f"Qwen2.5-VL stand-in ({TEXT_LAYERS} layers, {TEXT_WIDTH} wide) trained on the grammar, a 1-level "
               "AutoencoderKLQwenImage trained on renders (32 px <-> 4x16x16, 2x2 packed: 64 tokens), a Qwen-Image "
               "MMDiT ({num_layers} blocks) trained by rectified flow through megatron-core on renders of ShapeEval "
               "TRAIN prompts. Prompts go through the pipeline's own template, padded to the longest with a mask.")
"""The shipped model's description (RECIPE.md); ``{num_layers}`` is filled in."""


def text_components(*, seed: int):
    """(tokenizer, text_encoder), untrained."""
    from megaflow.models.tiny_pipeline import QWEN_TEMPLATE_WORDS, make_qwen_tokenizer, make_qwen_vl_encoder

    tok = make_qwen_tokenizer((*shapes_vocabulary(), *QWEN_TEMPLATE_WORDS))
    return tok, make_qwen_vl_encoder(tok, hidden=TEXT_WIDTH, seed=seed + 2, num_layers=TEXT_LAYERS)


def trained_encoders(text) -> list[tuple]:
    """The (tokenizer, encoder) pairs the grammar objective trains: the one Qwen2.5-VL."""
    return [(text[0], text[1])]


def finish_text(text) -> None:
    """Nothing after training (the encoder is used as trained)."""


# QwenImagePipeline's text-to-image prompt template (set in its __init__; both pipelines wrap every prompt in it).
_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
             "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
             "<|im_start|>assistant\n")


def word_positions(tokenizer, prompt: str) -> list[int]:
    """Token index of each word of ``prompt`` inside the template (one token a word after the template's prefix)."""
    words = prompt.split()
    prefix = len(tokenizer(_TEMPLATE.split("{}")[0])["input_ids"])
    empty = len(tokenizer(_TEMPLATE.format(""))["input_ids"])
    if len(tokenizer(_TEMPLATE.format(prompt))["input_ids"]) != empty + len(words):
        raise ValueError(f"tokenizer does not map every word of {prompt!r} to one token")
    return [prefix + i for i in range(len(words))]


def text_features(encoder, tokenizer, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token states [N, L, H] of the templated prompts as the pipeline reads them (the last layer), pooled
    [N, H]: the state of each prompt's last word, the one token that has seen the whole prompt)."""
    tok = tokenizer([_TEMPLATE.format(p) for p in prompts], padding=True, return_tensors="pt")
    states = encoder(input_ids=tok["input_ids"], attention_mask=tok["attention_mask"],
                     output_hidden_states=True).hidden_states[-1]
    last = torch.tensor([word_positions(tokenizer, p)[-1] if p else 0 for p in prompts])
    return states, states[torch.arange(len(prompts)), last]


def make_vae(*, seed: int):
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    return AutoencoderKLQwenImage(base_dim=16, z_dim=LATENT_CHANNELS, dim_mult=[1, 2], num_res_blocks=1,
                                  temperal_downsample=[False], latents_mean=[0.0] * LATENT_CHANNELS,
                                  latents_std=[1.0] * LATENT_CHANNELS)


def vae_posterior(vae, pixels: torch.Tensor):
    """The VAE's latent distribution of images [B, 3, H, W] in [-1, 1] (one-frame clips)."""
    return vae.encode(pixels[:, :, None]).latent_dist


def vae_reconstruct(vae, z: torch.Tensor) -> torch.Tensor:
    return vae.decode(z).sample[:, :, 0]


def set_latent_stats(vae, z: torch.Tensor) -> dict:
    """Per-channel mean and std of latents ``z`` [B, C, 1, h, w] as the VAE's ``latents_mean`` / ``latents_std``."""
    return set_channel_stats(vae, z)


@torch.no_grad()
def encode(vae, pixels: torch.Tensor) -> torch.Tensor:
    """Images [B, 3, H, W] in [-1, 1] -> normalised packed DiT latents [B, (h/2)(w/2), 4C] ((z - mean) / std,
    posterior mode), on the CPU (computed on the VAE's device)."""
    from diffusers import QwenImagePipeline

    z = vae.encode(pixels[:, :, None].to(vae.device)).latent_dist.mode()
    mean, std = channel_stats(vae, z.device)
    z = ((z - mean) / std)[:, :, 0]
    b, c, h, w = z.shape
    return QwenImagePipeline._pack_latents(z, b, c, h, w).cpu()


@torch.no_grad()
def decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """Normalised packed DiT latents -> images float [B, 3, H, W] in [0, 1] (as the Qwen-Image pipeline decodes),
    on the CPU."""
    from diffusers import QwenImagePipeline

    side = int(round((latents.shape[1]) ** 0.5)) * 2 * SPATIAL_FACTOR
    z = QwenImagePipeline._unpack_latents(latents.to(vae.device), side, side, SPATIAL_FACTOR)
    mean, std = channel_stats(vae, z.device)
    x = vae.decode(z * std + mean).sample[:, :, 0]
    return (x / 2 + 0.5).clamp(0, 1).cpu()


def latent_shape(num: int, resolution: int) -> tuple[int, ...]:
    side = resolution // SPATIAL_FACTOR // 2
    return (num, side * side, 4 * LATENT_CHANNELS)


def transformer_config(*, resolution: int, num_layers: int, num_heads: int, head_dim: int) -> dict:
    """The QwenImageTransformer2DModel config of the ShapeEval DiT (RoPE axes: a quarter of the head for the
    frame axis, the rest split between rows and columns)."""
    frame = head_dim // 4 // 2 * 2
    rows = (head_dim - frame) // 2 // 2 * 2
    return dict(patch_size=2, in_channels=4 * LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=num_layers,
                attention_head_dim=head_dim, num_attention_heads=num_heads, joint_attention_dim=TEXT_WIDTH,
                axes_dims_rope=(frame, rows, head_dim - frame - rows))


def resolution_of(config: dict) -> int | None:
    """None: the rotary DiT takes any image size."""
    return None


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")


def assemble(*, text, vae, transformer_config: dict, transformer_state: dict | None, seed: int = 0):
    """A QwenImagePipeline from the parts (transformer weights from ``transformer_state`` if given), with the
    published scheduler settings."""
    from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(**transformer_config).eval()
    if transformer_state is not None:
        missing, unexpected = transformer.load_state_dict(transformer_state, strict=False)
        if missing or unexpected:
            raise ValueError(f"transformer weights do not match the config: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
    tok, enc = text
    return QwenImagePipeline(transformer=transformer, scheduler=_scheduler(), vae=vae, text_encoder=enc, tokenizer=tok)


def load_parts(path: Path):
    """(text components, VAE, transformer config, transformer state dict) of a saved ShapeEval pipeline."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(path)
    tcfg = {k: v for k, v in pipe.transformer.config.items() if not k.startswith("_")}
    return (pipe.tokenizer, pipe.text_encoder), pipe.vae, tcfg, pipe.transformer.state_dict()


def after_save(directory: Path) -> None:
    """Nothing to add: both pipelines read the spatial factor from the VAE's own config."""


@torch.no_grad()
def conditioning(pipe, prompts: list[str], *, batch: int = 512) -> dict[str, torch.Tensor]:
    """The DiT's conditioning of each prompt as the pipeline computes it: ``encoder_hidden_states`` [N, L, D]
    padded with zeros to the longest prompt and ``encoder_hidden_states_mask`` [N, L] (1: a real token)."""
    parts = [pipe._get_qwen_prompt_embeds(prompts[i:i + batch], device=torch.device("cpu"), dtype=torch.float32)
             for i in range(0, len(prompts), batch)]
    longest = max(e.shape[1] for e, _ in parts)
    embeds = torch.cat([torch.nn.functional.pad(e, (0, 0, 0, longest - e.shape[1])) for e, _ in parts])
    mask = torch.cat([torch.nn.functional.pad(m, (0, longest - m.shape[1])) for _, m in parts])
    return {"encoder_hidden_states": embeds.float(), "encoder_hidden_states_mask": mask.long()}


def constant_inputs(resolution: int) -> dict[str, torch.Tensor]:
    """``img_shapes``: the packed token grid (1 frame, rows, columns) every sample shares."""
    side = resolution // SPATIAL_FACTOR // 2
    return {"img_shapes": torch.tensor((1, side, side))}


def sample_sigmas(pipe, num_steps: int, resolution: int) -> torch.Tensor:
    """The ODE sampler's sigma grid (num_steps + 1, ending at 0) as the pipeline sets it: linear sigmas shifted by
    the scheduler's dynamic shift for the image's token count."""
    import copy

    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    sched = copy.deepcopy(pipe.scheduler)
    cfg = sched.config
    image_tokens = math.prod(latent_shape(1, resolution)[1:-1])
    mu = calculate_shift(image_tokens, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    return sched.sigmas.float()
