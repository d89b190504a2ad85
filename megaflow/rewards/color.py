"""Colour-target reward: 1 - mean ||pixel - target||_2 / sqrt(3), in [0, 1]; target from config or the prompt's
first colour name (none: sample masked).
"""
from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch

from megaflow.data.colors import COLOR_NAMES, parse_color
from megaflow.rewards.base import ImageBatch, Reward, to_float

_COLOR_RE = re.compile(r"\b(" + "|".join(COLOR_NAMES) + r")\b", re.IGNORECASE)


def color_in_prompt(prompt: str) -> tuple[float, float, float]:
    """RGB in [0, 1] of the first colour named in the prompt; ValueError if there is none."""
    m = _COLOR_RE.search(prompt)
    if m is None:
        raise ValueError(f"no colour named in prompt {prompt!r}")
    return parse_color(m.group(1).lower())


class ColorTarget(Reward):
    """Reward = 1 - mean per-pixel RGB distance to the target colour / sqrt(3)."""

    name = "color_target"

    def __init__(self, *, target=None):
        self.target = None if target is None else parse_color(target)

    def __call__(self, images: ImageBatch, prompts: Sequence[str],
                 metadata: Sequence[dict] | None = None) -> torch.Tensor:
        x = to_float(images)  # [B, 3, H, W]
        if self.target is not None:
            targets = torch.tensor([self.target] * x.shape[0])
        else:
            targets = torch.tensor([color_in_prompt(p) for p in prompts])
        dist = (x - targets[:, :, None, None]).norm(dim=1)  # [B, H, W]
        return 1.0 - dist.flatten(1).mean(1) / math.sqrt(3.0)
