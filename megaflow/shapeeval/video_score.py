"""Video ShapeEval entry points without a model: score a folder of clips, the ground-truth renderer (the checker's
ceiling) and its corruptions (the checker's floor); results as the image benchmark's dicts (``score.summarize``)
with 95% intervals. Invariant: every prompt is parsed before any clip is decoded.
"""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from megaflow.data.video_shapes import VIDEO_CATEGORIES, parse_video_prompt, sample_video_scenes
from megaflow.shapeeval.score import summarize, with_intervals
from megaflow.shapeeval.video_checker import ClipScore, score_clip
from megaflow.shapeeval.video_io import list_clips, load_clip
from megaflow.shapeeval.video_render import CLIP_CORRUPTIONS, corrupt_clip, motion_step, render_clip


def summarize_clips(scores: list[ClipScore]) -> dict:
    """``score.summarize`` of clip verdicts with Wilson 95% intervals, plus the mean of each half of ``partial``
    (``frames_mean``: the frames' image scores; ``clause_mean``: the motion or change clause) and the per-clip
    ``passed`` list."""
    out = with_intervals(summarize(scores))
    out["frames_mean"] = float(np.mean([s.frames for s in scores]))
    out["clause_mean"] = float(np.mean([s.clause for s in scores]))
    out["passed"] = [bool(s.passed) for s in scores]
    return out


def score_clip_batch(clips: np.ndarray, prompts: list[str]) -> list[ClipScore]:
    """Verdicts of uint8 clips [N, F, H, W, 3] against their prompts."""
    return [score_clip(c, parse_video_prompt(p)) for c, p in zip(clips, prompts)]


def evaluate_clips(clips_dir: Path, *, num_frames: int | None = None) -> tuple[dict, list[np.ndarray], list[str]]:
    """(summary, clips, prompts) of a folder of clips (``video_io.list_clips``), each scored against its prompt;
    ValueError naming the first bad prompt (before any clip is read) or unreadable clip."""
    clips_dir = Path(clips_dir)
    items = list_clips(clips_dir)
    scenes = []
    for path, prompt in items:
        try:
            scenes.append(parse_video_prompt(prompt))
        except ValueError as e:
            raise ValueError(f"{path.name}: {e}") from None
    clips = [load_clip(path, num_frames=num_frames) for path, _ in items]
    scores = [score_clip(c, s) for c, s in zip(clips, scenes)]
    out = summarize_clips(scores)
    out["files"] = [str(p.relative_to(clips_dir)) if p.is_relative_to(clips_dir) else str(p) for p, _ in items]
    return out, clips, [prompt for _, prompt in items]


def _check(num: int, num_frames: int, resolution: int) -> None:
    if num < 1:
        raise ValueError(f"num must be >= 1, got {num}")
    motion_step(resolution, num_frames)  # ValueError when the clip cannot fit the canvas


def evaluate_video_ground_truth(num: int, *, num_frames: int = 5, seed: int = 0, resolution: int = 32,
                                split: str = "eval", supersample: int = 1) -> dict:
    """Render ``num`` prompts of ``split`` (round-robin over the categories) as ground-truth clips and score them:
    the checker's ceiling, 1.0."""
    _check(num, num_frames, resolution)
    rng = random.Random(seed)
    scores = [score_clip(render_clip(s, num_frames=num_frames, resolution=resolution, rng=rng,
                                     supersample=supersample), s)
              for s in sample_video_scenes(split, num, seed=seed)]
    return {**summarize_clips(scores), "num_frames": num_frames, "resolution": resolution, "seed": seed}


def evaluate_video_corruption(kind: str, num: int, *, num_frames: int = 5, seed: int = 0, resolution: int = 32,
                              categories: tuple[str, ...] = VIDEO_CATEGORIES) -> dict:
    """Score ``kind``-corrupted clips (``video_render.corrupt_clip``) of held-out prompts against the original
    prompts: accuracy 0. Prompts the kind does not apply to are skipped; ``num`` counts the scored ones."""
    _check(num, num_frames, resolution)
    if kind not in CLIP_CORRUPTIONS:
        raise ValueError(f"unknown clip corruption: {kind!r} (known: {', '.join(CLIP_CORRUPTIONS)})")
    rng = random.Random(seed)
    scores: list[ClipScore] = []
    for scene in sample_video_scenes("eval", 2 * num, seed=seed, categories=categories):
        clip = corrupt_clip(scene, kind, num_frames=num_frames, resolution=resolution, rng=rng)
        if clip is not None:
            scores.append(score_clip(clip, scene))
        if len(scores) == num:
            break
    if not scores:
        raise ValueError(f"corruption {kind!r} applies to none of the categories {', '.join(categories)}")
    return {**summarize_clips(scores), "corruption": kind, "num_frames": num_frames, "resolution": resolution,
            "seed": seed}
