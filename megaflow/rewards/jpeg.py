"""JPEG (in)compressibility rewards (DDPO), from the JPEG size in kB: ``jpeg_compressibility`` = -size,
``jpeg_incompressibility`` = +size.
"""
from __future__ import annotations

import io
from collections.abc import Sequence

import torch

from megaflow.rewards.base import ImageBatch, Reward, to_pil


def jpeg_size_kb(images: ImageBatch, quality: int = 95) -> torch.Tensor:
    """Bytes / 1000 of each image encoded as JPEG at ``quality``, float32 [B]."""
    sizes = []
    for im in to_pil(images):
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=quality)
        sizes.append(buf.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


class JpegCompressibility(Reward):
    """Reward = -JPEG size in kB."""

    name = "jpeg_compressibility"
    sign = -1.0

    def __init__(self, *, quality: int = 95):
        if not 1 <= quality <= 100:
            raise ValueError(f"JPEG quality must be in [1, 100], got {quality}")
        self.quality = quality

    def __call__(self, images: ImageBatch, prompts: Sequence[str],
                 metadata: Sequence[dict] | None = None) -> torch.Tensor:
        return self.sign * jpeg_size_kb(images, self.quality)


class JpegIncompressibility(JpegCompressibility):
    """Reward = +JPEG size in kB."""

    name = "jpeg_incompressibility"
    sign = 1.0
