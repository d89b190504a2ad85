"""CLIP-based rewards that read real models from a local directory (model hubs are never contacted):
``clipscore``, ``pickscore`` and ``aesthetic``.

Every reward loads a transformers ``CLIPModel`` with ``from_pretrained(dir)`` (float32, eval, on ``device``;
one copy per (directory, device) per process, shared by the rewards that name it) and a ``CLIPProcessor``
(``from_pretrained``). Images (any form ``megaflow.rewards.base`` accepts: usually a float tensor
[B, 3, H, W] in [0, 1]) go through ``to_uint8`` (rounded to 8 bits, what the published scores were computed
on) and the processor's image transform (resize, centre crop, normalise); prompts through its tokenizer,
padded and truncated to the text tower's positions (77 for CLIP). Embeddings are ``get_image_features`` /
``get_text_features``, L2-normalised, computed without gradients ``batch_size`` images at a time.

* ``clipscore`` (Hessel et al. 2021): ``w * max(cos(image, text), 0)``, ``w = 2.5``; ``prefix`` is prepended
  to each prompt (the paper uses ``"A photo depicts "``; default none).
* ``pickscore`` (Kirstain et al. 2023): ``logit_scale.exp() * cos(image, text)`` of the PickScore_v1 CLIP
  (processor from ``processor_path``, default ``path``). Reported RAW by default (the paper's score, ~18-23
  for ordinary images); ``scale`` multiplies it (``scale = 0.0384615`` = 1/26 gives the normalised variant
  some FlowGRPO recipes train on).
* ``aesthetic``: the LAION aesthetic predictor v2 shape: L2-normalised CLIP image embedding -> a head from
  ``head_path`` (see ``load_head``), the prompt unused.

``hpsv2`` (``megaflow.rewards.hps``) shares ``ClipEmbedder`` and ``shared_model`` with an OpenCLIP checkpoint
converted to a ``CLIPModel`` (``megaflow.rewards.openclip``).

The files are checked first (``megaflow.config.reward_files``): a missing directory is one line, before torch
loads anything.
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
    """CLIPScore: ``w * max(cos(image, prefix + prompt), 0)`` (see module docstring)."""

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
    """PickScore: ``scale * logit_scale.exp() * cos(image, prompt)``, raw by default (see module docstring)."""

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
