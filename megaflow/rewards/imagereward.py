"""``imagereward``: ImageReward (Xu et al. 2023) from a user-downloaded directory; hubs never contacted.
Design notes: docs/design/rewards.md.
"""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn

from megaflow.config.reward_files import check_model_reward
from megaflow.rewards.aesthetic import MLP_LINEARS, mlp_from_state, read_state_dict
from megaflow.rewards.base import ImageBatch, Reward, to_pil
from megaflow.rewards.clip import check_options, shared_model
from megaflow.rewards.openclip import OPENAI_MEAN, OPENAI_STD

MEAN, STD = 0.16717362830052426, 1.0333394966054072  # the release's normalisation of the head's output
MAX_TOKENS = 35
VISION_HEAD_DIM = 64  # BLIP's ViTs: base 768 / 12 heads, large 1024 / 16
VISION, TEXT, HEAD = "blip.visual_encoder.", "blip.text_encoder.", "mlp."
# BLIP ViT (timm) names -> transformers BlipVisionModel names
_VISION_NAMES = [
    (r"cls_token", "embeddings.class_embedding"),
    (r"pos_embed", "embeddings.position_embedding"),
    (r"patch_embed\.proj\.(weight|bias)", r"embeddings.patch_embedding.\1"),
    (r"blocks\.(\d+)\.norm([12])\.(weight|bias)", r"encoder.layers.\1.layer_norm\2.\3"),
    (r"blocks\.(\d+)\.attn\.qkv\.(weight|bias)", r"encoder.layers.\1.self_attn.qkv.\2"),
    (r"blocks\.(\d+)\.attn\.proj\.(weight|bias)", r"encoder.layers.\1.self_attn.projection.\2"),
    (r"blocks\.(\d+)\.mlp\.(fc[12])\.(weight|bias)", r"encoder.layers.\1.mlp.\2.\3"),
    (r"norm\.(weight|bias)", r"post_layernorm.\1"),
]


def _part(state: dict[str, torch.Tensor], prefix: str, where: str) -> dict[str, torch.Tensor]:
    part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not part:
        raise ValueError(f"{where}: no {prefix}* tensors (keys start {sorted(state)[:6]}); not an ImageReward "
                         "checkpoint")
    return part


def _layers(part: dict[str, torch.Tensor], pattern: str) -> int:
    return len({m.group(1) for k in part if (m := re.match(pattern, k))})


def vision_state(lavis: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """``blip.visual_encoder.*`` (prefix removed) under ``BlipVisionModel``'s names; unknown names refused."""
    out = {}
    for key, value in lavis.items():
        for pattern, name in _VISION_NAMES:
            if re.fullmatch(pattern, key):
                out[re.sub(pattern, name, key)] = value
                break
        else:
            raise ValueError(f"{where}: unexpected vision tensor {VISION}{key}")
    return out


def vision_model(lavis: dict[str, torch.Tensor], where: str) -> nn.Module:
    """The ViT of ``lavis`` (``blip.visual_encoder.*`` without the prefix) as a ``BlipVisionModel``."""
    from transformers import BlipVisionConfig, BlipVisionModel

    width = lavis["cls_token"].shape[-1]
    patch = lavis["patch_embed.proj.weight"].shape[-1]
    grid = round((lavis["pos_embed"].shape[1] - 1) ** 0.5)
    if grid * grid + 1 != lavis["pos_embed"].shape[1] or width % VISION_HEAD_DIM:
        raise ValueError(f"{where}: vision pos_embed {tuple(lavis['pos_embed'].shape)} / width {width}: expected a "
                         f"square patch grid and a width that is a multiple of {VISION_HEAD_DIM}")
    config = BlipVisionConfig(hidden_size=width, intermediate_size=lavis["blocks.0.mlp.fc1.weight"].shape[0],
                              num_hidden_layers=_layers(lavis, r"blocks\.(\d+)\."),
                              num_attention_heads=width // VISION_HEAD_DIM, image_size=grid * patch,
                              patch_size=patch, hidden_act="gelu", layer_norm_eps=1e-6, attention_dropout=0.0)
    return _loaded(BlipVisionModel(config), vision_state(lavis, where), where)


def text_model(lavis: dict[str, torch.Tensor], med: dict, where: str) -> nn.Module:
    """The cross-attention BERT of ``lavis`` (``blip.text_encoder.*`` without the prefix) as a ``BlipTextModel``
    (heads, activation and LayerNorm eps from ``med``, the med_config.json)."""
    from transformers import BlipTextConfig, BlipTextModel

    state = {k: v for k, v in lavis.items() if k != "embeddings.position_ids"}
    vocab, width = state["embeddings.word_embeddings.weight"].shape
    cross = "encoder.layer.0.crossattention.self.key.weight"
    if cross not in state:
        raise ValueError(f"{where}: the text encoder has no cross-attention ({TEXT}{cross} missing)")
    config = BlipTextConfig(vocab_size=vocab, hidden_size=width, encoder_hidden_size=state[cross].shape[1],
                            intermediate_size=state["encoder.layer.0.intermediate.dense.weight"].shape[0],
                            num_hidden_layers=_layers(state, r"encoder\.layer\.(\d+)\."),
                            num_attention_heads=int(med.get("num_attention_heads", 12)),
                            max_position_embeddings=state["embeddings.position_embeddings.weight"].shape[0],
                            hidden_act=med.get("hidden_act", "gelu"),
                            layer_norm_eps=float(med.get("layer_norm_eps", 1e-12)),
                            pad_token_id=int(med.get("pad_token_id", 0)), bos_token_id=None, eos_token_id=None,
                            sep_token_id=None, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0, is_decoder=True)  # is_decoder: build cross-attention
    return _loaded(BlipTextModel(config, add_pooling_layer=False), state, where)


def _loaded(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> nn.Module:
    try:
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise ValueError(f"{where}: tensors do not fit the inferred {type(model).__name__} ({lines[-1]})") from None
    return model


class ImageRewardModel(nn.Module):
    """ViT -> cross-attention BERT -> MLP head on [CLS] -> ``(head - MEAN) / STD`` (see the module's design notes)."""

    def __init__(self, vision: nn.Module, text: nn.Module, head: nn.Module):
        super().__init__()
        self.vision, self.text, self.head = vision, text, head

    @property
    def image_size(self) -> int:
        return int(self.vision.config.image_size)

    def forward(self, pixels: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B] scores of normalised [B, 3, S, S] pixels and [B, T] token ids / mask."""
        image = self.vision(pixel_values=pixels).last_hidden_state
        everything = torch.ones(image.shape[:2], dtype=torch.long, device=image.device)
        text = self.text(input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image,
                         encoder_attention_mask=everything, is_decoder=False).last_hidden_state
        return ((self.head(text[:, 0].float()) - MEAN) / STD).squeeze(-1)


def build_model(path: str | Path) -> ImageRewardModel:
    """The model of an ImageReward download ``path`` (``ImageReward.pt`` + ``med_config.json``), on the CPU."""
    checkpoint = Path(path) / "ImageReward.pt"
    where = f"imagereward {checkpoint}"
    state = read_state_dict(checkpoint, what="imagereward checkpoint")
    med = json.loads((Path(path) / "med_config.json").read_text())
    head_state = _part(state, HEAD, where)
    expected = {f"layers.{i}.{p}" for i in MLP_LINEARS for p in ("weight", "bias")}
    if set(head_state) != expected:
        raise ValueError(f"{where}: head tensors {sorted(head_state)} are not "
                         f"{HEAD}layers.{{0,2,4,6,7}}.{{weight,bias}}")
    head = nn.Sequential()
    head.add_module("layers", mlp_from_state(head_state))
    head = _loaded(head, head_state, where)
    text = text_model(_part(state, TEXT, where), med, where)
    vision = vision_model(_part(state, VISION, where), where)
    widths = (vision.config.hidden_size, text.config.encoder_hidden_size, text.config.hidden_size,
              head[0][0].in_features)
    if widths[0] != widths[1] or widths[2] != widths[3]:
        raise ValueError(f"{where}: widths disagree: ViT {widths[0]}, cross-attention input {widths[1]}, text "
                         f"{widths[2]}, head input {widths[3]}")
    return ImageRewardModel(vision, text, head)


def preprocess(images: ImageBatch, size: int) -> torch.Tensor:
    """[B, 3, size, size] float32 pixels as the release prepares them (the module's design notes)."""
    out = []
    for image in to_pil(images):
        w, h = image.size
        new = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)
        if new != (w, h):
            image = image.resize(new, Image.Resampling.BICUBIC)
        left, top = int(round((new[0] - size) / 2.0)), int(round((new[1] - size) / 2.0))
        image = image.crop((left, top, left + size, top + size))
        out.append(torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1))
    x = torch.stack(out).to(torch.float32) / 255.0
    return (x - torch.tensor(OPENAI_MEAN).view(3, 1, 1)) / torch.tensor(OPENAI_STD).view(3, 1, 1)  # as BLIP


def load_tokenizer(path: str):
    """The BERT tokenizer of directory ``path`` (local files only)."""
    from transformers import BertTokenizer
    return BertTokenizer.from_pretrained(path, local_files_only=True)


def tokenize(tokenizer, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
    """``input_ids`` / ``attention_mask`` [B, MAX_TOKENS]: padded to and truncated at ``MAX_TOKENS``."""
    out = tokenizer(list(prompts), padding="max_length", truncation=True, max_length=MAX_TOKENS,
                    return_tensors="pt")
    return {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"]}


class ImageRewardScore(Reward):
    """ImageReward's score of each image for its prompt (see the module's design notes)."""

    name = "imagereward"

    def __init__(self, *, path: str, tokenizer_path: str, device: str = "cpu", batch_size: int = 16):
        check_model_reward(self.name, {"path": path, "tokenizer_path": tokenizer_path})
        check_options(self.name, device, batch_size)
        self.device, self.batch_size = device, batch_size
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.model = shared_model("imagereward", path, device, lambda: build_model(path))
        vocab = self.model.text.config.vocab_size
        if len(self.tokenizer) > vocab:
            raise ValueError(f"reward 'imagereward': tokenizer {tokenizer_path} has {len(self.tokenizer)} tokens, "
                             f"the model's embedding {vocab}: not the tokenizer it was trained with")

    def __call__(self, images: ImageBatch, prompts: Sequence[str],
                 metadata: Sequence[dict] | None = None) -> torch.Tensor:
        pixels = preprocess(images, self.model.image_size)
        if len(prompts) != len(pixels):
            raise ValueError(f"reward 'imagereward': {len(pixels)} images but {len(prompts)} prompts")
        out = []
        for i in range(0, len(pixels), self.batch_size):
            tokens = tokenize(self.tokenizer, prompts[i:i + self.batch_size])
            with torch.no_grad():
                scores = self.model(pixels[i:i + self.batch_size].to(self.device),
                                    tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device))
            out.append(scores.float().cpu())
        return torch.cat(out)
