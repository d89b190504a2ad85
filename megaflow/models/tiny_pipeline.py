"""Write a tiny, randomly initialised diffusers pipeline (SD3, FLUX.1, Qwen-Image or Wan 2.1 T2V) to a directory,
offline.

Loads with diffusers and SGLang's native path on CPU; seeded and deterministic, a few MB, tokenizers
built in memory. Design notes: docs/design/models.md.
"""
from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import torch

from megaflow.families import DEFAULT_FAMILY, card

_WORDS = (
    "a photo of the an and with on in red green blue yellow white black orange purple cat dog circle "
    "square triangle star big small one two three shape background sky tree house car"
).split()
_CLIP_MAX_LEN = 77  # SD3/FLUX pipelines pad CLIP prompts to 77 tokens (the position-embedding table size)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte -> printable unicode map (the byte-level alphabet of CLIP's BPE)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def _bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Byte-pair encoding of one word: repeatedly merge the lowest-ranked adjacent pair."""
    while len(symbols) > 1:
        pairs = [(ranks.get(p, len(ranks)), i) for i, p in enumerate(zip(symbols, symbols[1:]))]
        rank, i = min(pairs)
        if rank == len(ranks):
            break
        symbols = symbols[:i] + [symbols[i] + symbols[i + 1]] + symbols[i + 2:]
    return symbols


def make_clip_tokenizer(words: tuple[str, ...] = _WORDS):
    """Byte-level BPE: every byte (plain and word-final), plus left-to-right merges spelling ``words``."""
    from transformers import CLIPTokenizer

    alphabet = list(_bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for tok in alphabet + [c + "</w>" for c in alphabet]:
        vocab.setdefault(tok, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in words:  # add merges until each word is one token under the merges so far (exact BPE order)
        symbols = _bpe(list(word[:-1]) + [word[-1] + "</w>"], {m: r for r, m in enumerate(merges)})
        while len(symbols) > 1:
            merges.append((symbols[0], symbols[1]))
            symbols = [symbols[0] + symbols[1]] + symbols[2:]
            vocab.setdefault(symbols[0], len(vocab))
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=_CLIP_MAX_LEN)


def make_t5_tokenizer(words: tuple[str, ...] = _WORDS):
    """Unigram vocab: <pad>, </s>, <unk>, then '▁'-prefixed words and single characters."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -1.0) for w in words]
    pieces += [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=512)


def make_clip_encoder(tokenizer, *, hidden: int, seed: int, with_projection: bool, num_layers: int = 2):
    """A ``num_layers`` CLIP text encoder whose special-token ids match ``tokenizer``."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=2, max_position_embeddings=_CLIP_MAX_LEN, projection_dim=hidden,
        hidden_act="quick_gelu", bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    cls = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return cls(config).eval()


def make_t5_encoder(tokenizer, *, d_model: int, seed: int):
    from transformers import T5Config, T5EncoderModel

    return _t5_like_encoder(T5Config, T5EncoderModel, tokenizer, d_model=d_model, seed=seed)


def _t5_like_encoder(config_cls, model_cls, tokenizer, *, d_model: int, seed: int):
    """A 2-layer, 2-head encoder of the T5 kind (T5, UMT5) for ``tokenizer``, seeded."""
    config = config_cls(
        vocab_size=len(tokenizer), d_model=d_model, d_kv=d_model // 2, d_ff=2 * d_model, num_layers=2,
        num_heads=2, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=0,
    )
    torch.manual_seed(seed)
    return model_cls(config).eval()


def make_vae(*, latent_channels: int, seed: int, shift_factor: float, scaling_factor: float):
    """A 4-level AutoencoderKL (spatial factor 8, like the real ones) with narrow channels."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=8, sample_size=64,
        shift_factor=shift_factor, scaling_factor=scaling_factor, use_quant_conv=False, use_post_quant_conv=False,
    ).eval()


def build_sd3(seed: int):
    """Tiny StableDiffusion3Pipeline: 2-layer MMDiT (hidden 64), CLIP-L/G stand-ins (32 wide), T5 (64 wide)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline

    clip_width, t5_width = 32, 64  # SD3 concatenates both CLIP widths and pads to the T5 width: 2*32 <= 64
    tok, tok2, tok3 = make_clip_tokenizer(), make_clip_tokenizer(), make_t5_tokenizer()
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=32,
        num_attention_heads=2, joint_attention_dim=t5_width, caption_projection_dim=64,
        pooled_projection_dim=2 * clip_width, pos_embed_max_size=card("sd3").tiny_positions,
    ).eval()
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=make_vae(latent_channels=16, seed=seed + 1, shift_factor=0.0609, scaling_factor=1.5305),
        text_encoder=make_clip_encoder(tok, hidden=clip_width, seed=seed + 2, with_projection=True),
        tokenizer=tok,
        text_encoder_2=make_clip_encoder(tok2, hidden=clip_width, seed=seed + 3, with_projection=True),
        tokenizer_2=tok2,
        text_encoder_3=make_t5_encoder(tok3, d_model=t5_width, seed=seed + 4),
        tokenizer_3=tok3,
    )


def build_flux(seed: int):
    """Tiny FluxPipeline (FLUX.1-dev layout: guidance embedding): 1 double + 1 single block, hidden 32."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    clip_width, t5_width = 32, 64
    tok, tok2 = make_clip_tokenizer(), make_t5_tokenizer()
    torch.manual_seed(seed)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=t5_width, pooled_projection_dim=clip_width,
        guidance_embeds=True, axes_dims_rope=(4, 6, 6),
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    )
    return FluxPipeline(
        transformer=transformer, scheduler=scheduler,
        vae=make_vae(latent_channels=16, seed=seed + 1, shift_factor=0.1159, scaling_factor=0.3611),
        text_encoder=make_clip_encoder(tok, hidden=clip_width, seed=seed + 2, with_projection=False),
        tokenizer=tok,
        text_encoder_2=make_t5_encoder(tok2, d_model=t5_width, seed=seed + 3),
        tokenizer_2=tok2,
    )


def make_umt5_encoder(tokenizer, *, d_model: int, seed: int):
    """A 2-layer UMT5 encoder (Wan's text encoder: per-layer relative position biases) for ``tokenizer``."""
    from transformers import UMT5Config, UMT5EncoderModel

    return _t5_like_encoder(UMT5Config, UMT5EncoderModel, tokenizer, d_model=d_model, seed=seed)


def make_wan_vae(*, seed: int):
    """A narrow AutoencoderKLWan with the published layout: 16 latent channels, spatial factor 8 (three
    downsamples), temporal factor 4 (the last two downsample time too, so F frames -> (F - 1) / 4 + 1)."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                            temperal_downsample=[False, True, True]).eval()


def build_wan(seed: int):
    """Tiny WanPipeline (Wan 2.1 T2V layout): 2-block WanTransformer3DModel (2 heads x 16, patch (1, 2, 2)),
    UMT5 (32 wide), AutoencoderKLWan (16 latent channels, 8x spatial, 4x temporal)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    text_width = 32
    tok = make_t5_tokenizer()
    torch.manual_seed(seed)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=16, out_channels=16,
        text_dim=text_width, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=card("wan").tiny_positions,
    ).eval()
    return WanPipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        vae=make_wan_vae(seed=seed + 1), text_encoder=make_umt5_encoder(tok, d_model=text_width, seed=seed + 2),
        tokenizer=tok,
    )


QWEN_TEMPLATE_WORDS = tuple(
    "system user assistant Describe image by detailing color shape size texture quantity text spatial "
    "relationships objects background".split())
_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def make_qwen_tokenizer(words: tuple[str, ...] = (*_WORDS, *QWEN_TEMPLATE_WORDS)):
    """Qwen2's byte-level BPE in miniature: every byte, merges spelling each word with and without its leading
    space ('Ġ'), and the chat special tokens; the Qwen-Image prompt template's system prefix is 34 tokens, as
    with the published tokenizer (both pipelines drop those 34)."""
    from transformers import Qwen2Tokenizer

    space = _bytes_to_unicode()[ord(" ")]
    vocab = {c: i for i, c in enumerate(_bytes_to_unicode().values())}
    merges: list[tuple[str, str]] = []
    for word in [w for word in words for w in (word, space + word)]:
        symbols = _bpe(list(word), {m: r for r, m in enumerate(merges)})
        while len(symbols) > 1:
            merges.append((symbols[0], symbols[1]))
            symbols = [symbols[0] + symbols[1]] + symbols[2:]
            vocab.setdefault(symbols[0], len(vocab))
    for special in _QWEN_SPECIALS:
        vocab[special] = len(vocab)
    return Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None,
                          additional_special_tokens=list(_QWEN_SPECIALS[1:]), model_max_length=32768)


def make_qwen_vl_encoder(tokenizer, *, hidden: int, seed: int, num_layers: int = 2):
    """A ``num_layers``-layer Qwen2.5-VL (text heads of 16 with multimodal RoPE sections, a 1-block vision tower)
    whose special-token ids match ``tokenizer``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")
    heads = hidden // 16
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=1,
                         max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=pad, eos_token_id=eos,
                         pad_token_id=pad, rope_parameters=dict(
                             rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3])),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=hidden,
                           fullatt_block_indexes=[0]),
        image_token_id=len(tokenizer) + 1, video_token_id=len(tokenizer) + 2,
        vision_start_token_id=len(tokenizer) + 3, vision_end_token_id=len(tokenizer) + 4)
    assert hidden // heads == 2 * (2 + 3 + 3)
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_qwen_image(seed: int):
    """Tiny QwenImagePipeline: 2 dual-stream blocks (hidden 32), a 2-layer Qwen2.5-VL (32 wide), a 3-level
    AutoencoderKLQwenImage (spatial factor 8, 4 latent channels) and the published scheduler settings."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)

    width, z = 32, 4
    tok = make_qwen_tokenizer()
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * z, out_channels=z, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=width, axes_dims_rope=(4, 6, 6)).eval()
    torch.manual_seed(seed + 1)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=z, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, True, True],
                                 latents_mean=[0.1, -0.2, 0.3, 0.0][:z], latents_std=[1.5, 2.0, 1.0, 2.5][:z]).eval()
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    return QwenImagePipeline(transformer=transformer, scheduler=scheduler, vae=vae,
                             text_encoder=make_qwen_vl_encoder(tok, hidden=width, seed=seed + 2), tokenizer=tok)


BUILDERS = {"sd3": build_sd3, "flux": build_flux, "qwen_image": build_qwen_image, "wan": build_wan}
"""The tiny pipeline of each family that has one: family name -> builder(seed)."""
FAMILIES = tuple(BUILDERS)


def make_tiny_pipeline(family: str, out: str | Path, *, seed: int = 0) -> Path:
    """Build the tiny ``family`` pipeline with weights drawn from ``seed`` and save it (fp32) to ``out``."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    pipe = BUILDERS[family](seed)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output directory {out} exists and is not empty")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)  # atomic: a crash never leaves a half-written pipeline at ``out``
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the builder never downloads; nor do the libraries it calls
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILIES, default=DEFAULT_FAMILY)
    parser.add_argument("--out", required=True, help="directory to write the pipeline into")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (same seed => same weights)")
    args = parser.parse_args(argv)
    out = make_tiny_pipeline(args.family, args.out, seed=args.seed)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote tiny {args.family} pipeline to {out} ({size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
