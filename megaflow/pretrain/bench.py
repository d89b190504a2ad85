"""The benchmark a family's kit pretrains on: image ShapeEval, or video ShapeEval when the kit declares ``FRAMES``
(a clip length). Prompts, ground-truth renders (the VAE's input, [-1, 1]), the text objective's parse and the
evaluation's scoring all follow from that one declaration. Invariant: the image benchmark draws prompts, seeds and
renders exactly as ``megaflow pretrain`` did before video existed, so image pipelines come out bit-identical.
"""
from __future__ import annotations

import math

import numpy as np
import torch


def to_pixels(images_uint8: np.ndarray) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float [B, 3, H, W] in [-1, 1] (the VAE's input range); clips uint8 [B, F, H, W, 3]
    -> [B, 3, F, H, W] (the video VAE's layout)."""
    x = torch.from_numpy(images_uint8)
    x = x.permute(0, 3, 1, 2) if x.ndim == 4 else x.permute(0, 4, 1, 2, 3)
    return x.float() / 127.5 - 1.0


class ImageBench:
    """Image ShapeEval: TRAIN prompts of the trained categories, held-out categories for evaluation."""

    frames = None

    def text_prompts(self) -> tuple[list[str], list[str]]:
        """(every TRAIN prompt, every other held-out prompt): what the text objective trains and checks on."""
        from megaflow.data.shapes import CATEGORIES, HELD_OUT_CATEGORIES, split_prompts
        split = split_prompts(seed=0)
        return ([s.prompt for c in CATEGORIES for s in split.train[c]],
                [s.prompt for c in HELD_OUT_CATEGORIES for s in split.eval[c]][::2])

    def parse(self, prompt: str):
        from megaflow.data.shapes import parse_prompt
        return parse_prompt(prompt)

    def sample_train(self, num: int, *, seed: int) -> list[str]:
        from megaflow.data.shapes import sample_prompts
        return sample_prompts("train", num, seed=seed)

    def render(self, prompts: list[str], *, resolution: int, seed: int) -> torch.Tensor:
        from megaflow.shapeeval.render import render_prompts
        return to_pixels(render_prompts(prompts, resolution=resolution, seed=seed))

    def eval_prompts(self, num: int, seed: int) -> tuple[list[str], list[str]]:
        """(held-out prompts, seen-category prompts) of ``shapeeval.evaluate.eval_prompts``."""
        from megaflow.shapeeval.evaluate import eval_prompts
        return eval_prompts(num, max(2, num // 5), seed)

    def score(self, samples: torch.Tensor, prompts: list[str]) -> dict:
        """ShapeEval summary of decoded images [N, 3, H, W] in [0, 1]."""
        from megaflow.shapeeval.evaluate import score
        return score(samples, prompts)


class VideoBench:
    """Video ShapeEval of ``frames``-frame clips: TRAIN scenes of every category (each category repeated to the
    largest one's size, so the text and VAE objectives see motions and colour changes alike), the held-out scenes
    of every category for evaluation and the TRAIN split as "seen"."""

    def __init__(self, frames: int):
        self.frames = frames

    def text_prompts(self) -> tuple[list[str], list[str]]:
        from megaflow.data.video_shapes import split_video_prompts
        split = split_video_prompts(seed=0)
        most = max(len(v) for v in split["train"].values())
        train = [s.prompt for v in split["train"].values() for s in v * math.ceil(most / len(v))]
        return train, [s.prompt for v in split["eval"].values() for s in v][::2]

    def parse(self, prompt: str):
        from megaflow.data.video_shapes import parse_video_prompt
        return parse_video_prompt(prompt)

    def sample_train(self, num: int, *, seed: int) -> list[str]:
        from megaflow.data.video_shapes import sample_video_prompts
        return sample_video_prompts("train", num, seed=seed)

    def render(self, prompts: list[str], *, resolution: int, seed: int) -> torch.Tensor:
        from megaflow.shapeeval.video_render import render_video_prompts
        return to_pixels(render_video_prompts(prompts, num_frames=self.frames, resolution=resolution, seed=seed))

    def eval_prompts(self, num: int, seed: int) -> tuple[list[str], list[str]]:
        """(held-out prompts of every category, TRAIN prompts: a fifth as many, at least 2), round-robin."""
        from megaflow.data.video_shapes import sample_video_prompts
        return sample_video_prompts("eval", num, seed=seed), sample_video_prompts("train", max(2, num // 5), seed=seed)

    def score(self, samples: torch.Tensor, prompts: list[str]) -> dict:
        """Video ShapeEval summary of decoded clips [N, F, 3, H, W] in [0, 1] (``video_score.summarize_clips``)."""
        from megaflow.shapeeval.video_evaluate import clips_uint8
        from megaflow.shapeeval.video_score import score_clip_batch, summarize_clips
        return summarize_clips(score_clip_batch(clips_uint8(samples), prompts))


def bench_of(kit) -> ImageBench | VideoBench:
    """Video ShapeEval for a kit declaring ``FRAMES`` (not None), else image ShapeEval."""
    return VideoBench(kit.FRAMES) if kit.FRAMES else ImageBench()
