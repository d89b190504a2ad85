"""OpenCLIP checkpoints as transformers ``CLIPModel``s (no open_clip needed), and HPSv2's inference transform.
Checkpoints: tensors only (``weights_only=True`` or safetensors). Design notes: docs/design/rewards.md.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
VISION_HEAD_WIDTH = {1280: 80, 1408: 88, 1664: 104}  # ViT-H-14, ViT-g-14, ViT-bigG-14; any other width: 64
TEXT_HEAD_WIDTH = 64
_BLOCK = re.compile(r"^(visual\.)?transformer\.resblocks\.(\d+)\.")
# a block's OpenCLIP module -> its transformers module (the fused attn.in_proj is split in three: see _block)
_BLOCK_NAMES = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.out_proj": "self_attn.out_proj",
                "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
_TOP_NAMES = {  # open_clip name -> transformers CLIPModel name (projections are transposed in convert)
    "visual.conv1.weight": "vision_model.embeddings.patch_embedding.weight",
    "visual.class_embedding": "vision_model.embeddings.class_embedding",
    "visual.positional_embedding": "vision_model.embeddings.position_embedding.weight",
    "visual.ln_pre.weight": "vision_model.pre_layrnorm.weight",
    "visual.ln_pre.bias": "vision_model.pre_layrnorm.bias",
    "visual.ln_post.weight": "vision_model.post_layernorm.weight",
    "visual.ln_post.bias": "vision_model.post_layernorm.bias",
    "visual.proj": "visual_projection.weight",
    "token_embedding.weight": "text_model.embeddings.token_embedding.weight",
    "positional_embedding": "text_model.embeddings.position_embedding.weight",
    "ln_final.weight": "text_model.final_layer_norm.weight",
    "ln_final.bias": "text_model.final_layer_norm.bias",
    "text_projection": "text_projection.weight",
    "logit_scale": "logit_scale",
}
_TRANSPOSED = {"visual.proj", "text_projection"}


def read_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """The OpenCLIP state dict in ``path`` (the module's design notes), on the CPU; ValueError (one line) otherwise."""
    from megaflow.rewards.aesthetic import read_state_dict
    sd = read_state_dict(path, "open_clip checkpoint", nested="state_dict")
    if sd and all(k.startswith("module.") for k in sd):  # saved from a DistributedDataParallel wrapper
        sd = {k[len("module."):]: v for k, v in sd.items()}
    missing = [k for k in _TOP_NAMES if k not in sd]
    if missing:
        raise ValueError(f"open_clip checkpoint {path}: not an OpenCLIP ViT checkpoint (missing {missing[:4]}; "
                         f"keys start {sorted(sd)[:4]})")
    return sd


def _layers(sd: dict[str, torch.Tensor], visual: bool) -> int:
    found = {int(m.group(2)) for k in sd if (m := _BLOCK.match(k)) and bool(m.group(1)) == visual}
    if not found or found != set(range(len(found))):
        raise ValueError(f"open_clip checkpoint: the {'image' if visual else 'text'} tower's transformer blocks "
                         f"are not numbered 0..N-1 (found {sorted(found)[:8]})")
    return len(found)


def _heads(width: int, heads: int | None, head_width: int, tower: str) -> int:
    heads = heads if heads is not None else width // head_width
    if heads < 1 or width % heads:
        raise ValueError(f"open_clip checkpoint: the {tower} tower's width {width} does not split into {heads} "
                         "attention heads (pass its head count)")
    return heads


def openclip_config(sd: dict[str, torch.Tensor], *, vision_heads: int | None = None, text_heads: int | None = None,
                    hidden_act: str = "gelu"):
    """The transformers ``CLIPConfig`` of OpenCLIP state dict ``sd`` (the module's design
    notes: what the shapes say)."""
    from transformers import CLIPConfig
    v_width, _, patch, _ = sd["visual.conv1.weight"].shape
    grid = round((sd["visual.positional_embedding"].shape[0] - 1) ** 0.5)
    if grid * grid + 1 != sd["visual.positional_embedding"].shape[0]:
        raise ValueError("open_clip checkpoint: visual.positional_embedding is not a square grid plus a class token")
    vocab, t_width = sd["token_embedding.weight"].shape
    embed = sd["text_projection"].shape[1]
    if sd["visual.proj"].shape[1] != embed:
        raise ValueError(f"open_clip checkpoint: image embedding width {sd['visual.proj'].shape[1]} != text {embed}")
    vision = dict(hidden_size=int(v_width), num_hidden_layers=_layers(sd, True), image_size=int(grid * patch),
                  intermediate_size=int(sd["visual.transformer.resblocks.0.mlp.c_fc.weight"].shape[0]),
                  num_attention_heads=_heads(int(v_width), vision_heads, VISION_HEAD_WIDTH.get(int(v_width), 64),
                                             "image"),
                  patch_size=int(patch), hidden_act=hidden_act, projection_dim=int(embed))
    text = dict(vocab_size=int(vocab), hidden_size=int(t_width), num_hidden_layers=_layers(sd, False),
                intermediate_size=int(sd["transformer.resblocks.0.mlp.c_fc.weight"].shape[0]),
                num_attention_heads=_heads(int(t_width), text_heads, TEXT_HEAD_WIDTH, "text"),
                max_position_embeddings=int(sd["positional_embedding"].shape[0]), hidden_act=hidden_act,
                projection_dim=int(embed), eos_token_id=int(vocab) - 1, bos_token_id=int(vocab) - 2)
    return CLIPConfig(text_config=text, vision_config=vision, projection_dim=int(embed))


def _block(sd: dict[str, torch.Tensor], src: str, dst: str, used: set[str]) -> dict[str, torch.Tensor]:
    """One transformer block's tensors under transformers' names (the fused q/k/v projection split); the OpenCLIP
    names read are added to ``used``."""
    out = {}
    for name, kind in (("in_proj_weight", "weight"), ("in_proj_bias", "bias")):
        q, k, v = sd[f"{src}attn.{name}"].chunk(3, dim=0)
        out.update({f"{dst}self_attn.q_proj.{kind}": q, f"{dst}self_attn.k_proj.{kind}": k,
                    f"{dst}self_attn.v_proj.{kind}": v})
        used.add(f"{src}attn.{name}")
    for old, new in _BLOCK_NAMES.items():
        for kind in ("weight", "bias"):
            out[f"{dst}{new}.{kind}"] = sd[f"{src}{old}.{kind}"]
            used.add(f"{src}{old}.{kind}")
    return out


def convert_state_dict(sd: dict[str, torch.Tensor], vision_layers: int, text_layers: int) -> dict[str, torch.Tensor]:
    """``sd`` (OpenCLIP names) as a transformers ``CLIPModel`` state dict, float32; ValueError naming the keys left
    over (a layout this conversion does not know, e.g. layer scales or an attention pooler) or missing."""
    used = set(_TOP_NAMES)
    out = {new: (sd[old].t() if old in _TRANSPOSED else sd[old]) for old, new in _TOP_NAMES.items()}
    try:
        for i in range(vision_layers):
            out.update(_block(sd, f"visual.transformer.resblocks.{i}.", f"vision_model.encoder.layers.{i}.", used))
        for i in range(text_layers):
            out.update(_block(sd, f"transformer.resblocks.{i}.", f"text_model.encoder.layers.{i}.", used))
    except KeyError as e:
        raise ValueError(f"open_clip checkpoint: unsupported layout (no {e.args[0]})") from None
    extra = sorted(k for k in sd if k not in used and not k.endswith("attn_mask"))  # a saved causal mask: unused
    if extra:
        raise ValueError(f"open_clip checkpoint: unsupported layout (unexpected keys {extra[:6]})")
    return {k: v.detach().to(torch.float32).contiguous() for k, v in out.items()}


def openclip_to_clip(sd: dict[str, torch.Tensor], **config_kwargs):
    """A transformers ``CLIPModel`` (float32, CPU, eval) holding OpenCLIP state dict ``sd``; ``config_kwargs``
    go to ``openclip_config``. Built on the meta device, so no random initialisation is paid for."""
    from transformers import CLIPModel
    try:
        config = openclip_config(sd, **config_kwargs)
    except KeyError as e:
        raise ValueError(f"open_clip checkpoint: unsupported layout (no {e.args[0]})") from None
    state = convert_state_dict(sd, config.vision_config.num_hidden_layers, config.text_config.num_hidden_layers)
    with torch.device("meta"):
        model = CLIPModel(config)
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"open_clip checkpoint: inconsistent shapes ({str(e).splitlines()[-1].strip()})") from None
    for module in model.modules():  # the only non-persistent buffers: position ids 0..n-1
        if isinstance(getattr(module, "position_ids", None), torch.Tensor) and module.position_ids.is_meta:
            module.position_ids = torch.arange(module.position_ids.shape[-1]).expand((1, -1))
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"open_clip checkpoint: no value for {left[:4]}")
    return model.eval().requires_grad_(False)


def load_openclip(path: str | Path, **config_kwargs):
    """``openclip_to_clip(read_checkpoint(path))``."""
    return openclip_to_clip(read_checkpoint(path), **config_kwargs)


def openclip_pixels(arrays: Sequence[np.ndarray], size: int, mean: Sequence[float] = OPENAI_MEAN,
                    std: Sequence[float] = OPENAI_STD) -> torch.Tensor:
    """HPSv2's inference transform of uint8 [H, W, 3] images: to float [0, 1] FIRST, antialiased bicubic resize of the
    shorter side to ``size``, centre crop, per-channel normalisation; float32 [B, 3, size, size]."""
    out = []
    for a in arrays:
        x = torch.from_numpy(np.ascontiguousarray(a)).permute(2, 0, 1).float().div(255.0)
        h, w = x.shape[-2:]
        long = int(size * max(h, w) / min(h, w))
        new_h, new_w = (size, long) if h <= w else (long, size)
        if (new_h, new_w) != (h, w):
            x = F.interpolate(x[None], size=(new_h, new_w), mode="bicubic", align_corners=False, antialias=True)[0]
        top, left = int(round((new_h - size) / 2.0)), int(round((new_w - size) / 2.0))
        out.append(x[:, top:top + size, left:left + size])
    x = torch.stack(out)
    return (x - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
