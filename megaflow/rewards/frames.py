"""Video rewards from image rewards (``reward.frames``): a clip batch [B, F, 3, H, W] float32 in [0, 1] is scored
per frame by an image reward and reduced to one score per clip (the mean over frames, the first frame, or a chosen
frame), or handed whole to a reward that takes video (``takes_video = True``). Invariant: an image batch
[B, 3, H, W] reaches the reward unchanged, whatever ``reward.frames`` says."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FRAME_MODES = ("mean", "first", "video")
"""``reward.frames``' words; a frame index ("0", "8", ...) is also accepted."""


def frame_mode(value: str) -> str | int:
    """``reward.frames`` as a mode word or a frame index (ValueError naming the choices)."""
    if value in FRAME_MODES:
        return value
    if value.isdigit():
        return int(value)
    raise ValueError(f"reward.frames = {value!r}: must be one of {', '.join(FRAME_MODES)} or a frame index (\"8\")")


def takes_video(reward) -> bool:
    """Whether ``reward`` (or the function / instance a ``'pkg.mod:fn'`` reward wraps) scores whole clips."""
    return bool(getattr(reward, "takes_video", False) or getattr(getattr(reward, "fn", None), "takes_video", False))


class FrameReward:
    """An image reward as a video reward: ``mode`` "mean" scores every frame (one batch of B x F images, each
    with its clip's prompt and metadata) and averages them per clip (a masked frame masks its clip), "first" or a
    frame index scores that frame; "video" hands the clip to a reward that takes video."""

    def __init__(self, reward, mode: str | int, *, label: str):
        if mode == "video" and not takes_video(reward):
            raise ValueError(f"reward {label!r} scores images, not video: set reward.frames to mean, first or a "
                             "frame index (or give the reward takes_video = True)")
        self.reward, self.mode, self.label = reward, mode, label
        self.name = getattr(reward, "name", label)

    def __call__(self, images, prompts: Sequence[str], metadata: Sequence[dict] | None = None):
        if not (isinstance(images, torch.Tensor) and images.ndim == 5) or self.mode == "video":
            return self.reward(images, prompts, metadata)
        frames = images.shape[1]
        if self.mode != "mean":
            index = 0 if self.mode == "first" else self.mode
            if index >= frames:
                raise ValueError(f"reward.frames = {index}: the clips have {frames} frames")
            return self.reward(images[:, index], prompts, metadata)
        meta = list(metadata) if metadata is not None else [{} for _ in prompts]
        out = self.reward(images.flatten(0, 1), [p for p in prompts for _ in range(frames)],
                          [m for m in meta for _ in range(frames)])
        scores, info = out if isinstance(out, tuple) else (out, None)
        per_clip = torch.as_tensor(scores, dtype=torch.float32).reshape(len(prompts), frames).mean(dim=1)
        return per_clip if info is None else (per_clip, info)


def score_per_frame(clips: torch.Tensor, prompts: Sequence[str], rewards: dict[str, dict], mode: str) -> dict:
    """{reward: {"mean", "masked", "scores"}}: each image reward (name -> keyword arguments) on float clips
    [N, F, 3, H, W] by ``mode`` (``reward.frames``' words or a frame index, as ``FrameReward``), one score per clip
    (None where the reward masked it; ``mean`` over the others, None when none is left). ``megaflow eval video``."""
    from megaflow.rewards.base import safe_score
    from megaflow.rewards.registry import build_reward

    mode_ = frame_mode(mode)
    if isinstance(mode_, int) and mode_ >= clips.shape[1]:
        raise ValueError(f"reward frame {mode_}: the clips have {clips.shape[1]} frames")
    out = {}
    for name, kwargs in rewards.items():
        fn = FrameReward(build_reward(name, **kwargs), mode_, label=name)
        scores = [float(s) for s in safe_score(fn, clips, list(prompts), name=name)]
        kept = [s for s in scores if math.isfinite(s)]
        out[name] = {"mean": sum(kept) / len(kept) if kept else None, "masked": len(scores) - len(kept),
                     "scores": [s if math.isfinite(s) else None for s in scores]}
    return out
