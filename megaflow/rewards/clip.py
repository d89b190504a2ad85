"""CLIP-based rewards from a local directory (hubs never contacted): ``clipscore``, ``pickscore``, ``aesthetic``.
Design notes: docs/design/rewards.md.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from megaflow.config.reward_files import check_model_reward
from megaflow.rewards.base import ImageBatch, Reward, to_uint8

_MODELS: dict[tuple[str, str, str], nn.Module] = {}
_LOCK = threading.Lock()


def _features(out) -> torch.Tensor:
    """A ``get_*_features`` result as a tensor (transformers 5 returns a ModelOutput whose pooler_output holds
    the projected features; earlier versions the tensor itself)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def shared_model(kind: str, path: str, device: str, load: Callable[[], nn.Module]) -> nn.Module:
    """The process's ``kind`` model from ``path`` on ``device``: ``load()`` on first use (then moved, eval, frozen),
    the same module afterwards."""
    with _LOCK:
        if (kind, path, device) not in _MODELS:
            _MODELS[kind, path, device] = load().to(device).eval().requires_grad_(False)
        return _MODELS[kind, path, device]


def load_clip(path: str, device: str) -> nn.Module:
    """The process's ``CLIPModel`` from directory ``path`` on ``device`` (loaded on first use, then shared)."""
    def load() -> nn.Module:
        from transformers import CLIPModel
        return CLIPModel.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    return shared_model("clip", path, device, load)


def check_number(name: str, key: str, value: object) -> float:
    """``value`` as a finite float; one-line ValueError naming the reward's argument otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"reward {name!r}: {key} must be a finite number, got {value!r}")
    return float(value)


def check_options(name: str, device: object, batch_size: object) -> None:
    if not isinstance(device, str) or not device:
        raise ValueError(f"reward {name!r}: device must be a string such as 'cpu' or 'cuda:0', got {device!r}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"reward {name!r}: batch_size must be an integer >= 1, got {batch_size!r}")


class ClipEmbedder:
    """L2-normalised CLIP image and text embeddings from a local model (and processor) directory, or (``of``) from
    a model, tokenizer and image transform at hand."""

    def __init__(self, path: str, *, processor_path: str | None = None, device: str = "cpu", batch_size: int = 16):
        from transformers import CLIPProcessor
        processor = CLIPProcessor.from_pretrained(processor_path or path, local_files_only=True)
        transform = processor.image_processor
        self._setup(load_clip(path, device), processor.tokenizer,
                    lambda arrays: transform(images=arrays, return_tensors="pt")["pixel_values"], device, batch_size)

    @classmethod
    def of(cls, model: nn.Module, tokenizer, pixels: Callable[[list[np.ndarray]], torch.Tensor], *,
           device: str = "cpu", batch_size: int = 16) -> ClipEmbedder:
        """An embedder of ``model`` (a ``CLIPModel`` on ``device``), ``tokenizer`` (a transformers tokenizer) and
        ``pixels`` (uint8 [H, W, 3] arrays -> the model's float pixel batch [B, 3, S, S])."""
        self = cls.__new__(cls)
        self._setup(model, tokenizer, pixels, device, batch_size)
        return self

    def _setup(self, model: nn.Module, tokenizer, pixels: Callable, device: str, batch_size: int) -> None:
        self.model, self.tokenizer, self.pixels = model, tokenizer, pixels
        self.device, self.batch_size = device, batch_size

    def images(self, images: ImageBatch) -> torch.Tensor:
        """[B, D] unit-norm image embeddings (float32, on the CPU)."""
        arrays, out = list(to_uint8(images)), []
        for i in range(0, len(arrays), self.batch_size):
            pixels = self.pixels(arrays[i:i + self.batch_size])
            with torch.no_grad():
                emb = _features(self.model.get_image_features(pixel_values=pixels.to(self.device)))
            out.append(emb.float().cpu())
        return nn.functional.normalize(torch.cat(out), dim=-1)

    def texts(self, prompts: Sequence[str]) -> torch.Tensor:
        """[B, D] unit-norm text embeddings (float32, on the CPU)."""
        max_len = self.model.config.text_config.max_position_embeddings
        out = []
        for i in range(0, len(prompts), self.batch_size):
            tokens = self.tokenizer(list(prompts[i:i + self.batch_size]), padding=True, truncation=True,
                                    max_length=max_len, return_tensors="pt")
            with torch.no_grad():
                emb = _features(self.model.get_text_features(input_ids=tokens["input_ids"].to(self.device),
                                                             attention_mask=tokens["attention_mask"].to(self.device)))
            out.append(emb.float().cpu())
        return nn.functional.normalize(torch.cat(out), dim=-1)

    def cosine(self, images: ImageBatch, prompts: Sequence[str]) -> torch.Tensor:
        """[B] cosine similarity of each image with its prompt."""
        return (self.images(images) * self.texts(prompts)).sum(-1)


class ClipScore(Reward):
    """CLIPScore: ``w * max(cos(image, prefix + prompt), 0)`` (see the module's design notes)."""

    name = "clipscore"

    def __init__(self, *, path: str, device: str = "cpu", batch_size: int = 16, w: float = 2.5, prefix: str = ""):
        check_model_reward(self.name, {"path": path})
        check_options(self.name, device, batch_size)
        if not isinstance(prefix, str):
            raise ValueError(f"reward 'clipscore': prefix must be a string, got {prefix!r}")
        self.w, self.prefix = check_number(self.name, "w", w), prefix
        self.clip = ClipEmbedder(path, device=device, batch_size=batch_size)

    def __call__(self, images: ImageBatch, prompts: Sequence[str],
                 metadata: Sequence[dict] | None = None) -> torch.Tensor:
        cos = self.clip.cosine(images, [self.prefix + p for p in prompts])
        return self.w * cos.clamp(min=0.0)


class PickScore(Reward):
    """PickScore: ``scale * logit_scale.exp() * cos(image, prompt)``, raw by default (see the module's design notes)."""

    name = "pickscore"

    def __init__(self, *, path: str, processor_path: str | None = None, device: str = "cpu", batch_size: int = 16,
                 scale: float = 1.0):
        check_model_reward(self.name, {"path": path, "processor_path": processor_path})
        check_options(self.name, device, batch_size)
        self.scale = check_number(self.name, "scale", scale)
        self.clip = ClipEmbedder(path, processor_path=processor_path, device=device, batch_size=batch_size)

    def __call__(self, images: ImageBatch, prompts: Sequence[str],
                 metadata: Sequence[dict] | None = None) -> torch.Tensor:
        logit_scale = float(self.clip.model.logit_scale.exp())
        return self.scale * logit_scale * self.clip.cosine(images, prompts)
