"""ShapeEval reward: ``shapeeval`` 0/1 (exact pass), ``shapeeval_partial`` graded in [0, 1]; a prompt outside
the grammar masks the sample.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from megaflow.data.shapes import parse_prompt
from megaflow.shapeeval.checker import score_image
from megaflow.rewards.base import ImageBatch, Reward, to_uint8


class ShapeEvalReward(Reward):
    """Per-image ShapeEval score; ``graded`` picks partial score over pass/fail."""

    def __init__(self, *, graded: bool = False):
        self.graded = graded
        self.name = "shapeeval_partial" if graded else "shapeeval"

    def __call__(self, images: ImageBatch, prompts: Sequence[str],
                 metadata: Sequence[dict] | None = None) -> torch.Tensor:
        arr = to_uint8(images)
        scores = []
        for img, prompt in zip(arr, prompts):
            verdict = score_image(img, parse_prompt(prompt))
            scores.append(verdict.partial if self.graded else float(verdict.passed))
        return torch.tensor(scores, dtype=torch.float32)
