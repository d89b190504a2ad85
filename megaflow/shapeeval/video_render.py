"""Ground-truth clips for video ShapeEval scenes, and the clip corruptions the tests score. Invariant: a moving clip
is one still layout (``render.place_objects``, so relations hold as in the image benchmark) shifted by a whole
number of pixels per frame, the same for every object, and every frame keeps every object inside the canvas.
Design notes: docs/design/video_shapeeval.md.
"""
from __future__ import annotations

import dataclasses
import random

import numpy as np

from megaflow.data.shapes import BACKGROUND, PALETTE, Scene
from megaflow.data.video_shapes import DIRECTIONS, VideoScene, parse_video_prompt
from megaflow.shapeeval import CLIP_CORRUPTIONS
from megaflow.shapeeval.render import PlacedObject, place_objects, render_objects

TRAVEL = 0.25  # the whole motion, as a fraction of the side, when frames allow (at least 1 px a frame)
MAX_TRAVEL = 0.35  # more frames than fit this at 1 px a frame are refused
_MAX_LAYOUTS = 200


def motion_step(resolution: int, num_frames: int) -> int:
    """Pixels an object moves per frame: ``TRAVEL`` of the side over the clip, rounded, at least 1; ValueError
    when the clip is too long for the canvas (more than ``MAX_TRAVEL`` of the side)."""
    if num_frames < 2:
        raise ValueError(f"a video ShapeEval clip has at least 2 frames, got {num_frames}")
    step = max(1, round(TRAVEL * resolution / (num_frames - 1)))
    if step * (num_frames - 1) > MAX_TRAVEL * resolution:
        most = int(MAX_TRAVEL * resolution) + 1
        raise ValueError(f"{num_frames} frames move objects off a {resolution} px canvas (at most {most} frames)")
    return step


def change_frame(num_frames: int) -> int:
    """The first frame in the new colour of a colour change: the middle one."""
    return num_frames // 2


def _shifted(objects: list[PlacedObject], dx: int, dy: int) -> list[PlacedObject]:
    return [dataclasses.replace(o, x0=o.x0 + dx, y0=o.y0 + dy) for o in objects]


def _moving_layout(scene: VideoScene, resolution: int, travel: int, rng: random.Random) -> list[PlacedObject]:
    """A still layout of the scene, moved so that its path of ``travel`` pixels stays inside the canvas."""
    ux, uy = DIRECTIONS[scene.motion]
    for _ in range(_MAX_LAYOUTS):
        objects = place_objects(scene.scene, resolution=resolution, rng=rng)
        lo = min(o.x0 if ux else o.y0 for o in objects)
        hi = max((o.x0 if ux else o.y0) + o.size for o in objects)
        room = (resolution - 2) - (hi - lo) - travel  # free pixels along the axis once the path is drawn
        if room < 0:
            continue
        start = 1 + rng.randint(0, room)  # where the path's low end lies
        first = start if (ux or uy) > 0 else start + travel
        return _shifted(objects, (first - lo) * abs(ux), (first - lo) * abs(uy))
    raise RuntimeError(f"could not lay out {scene.prompt!r} moving {travel} px at {resolution} px")


def clip_objects(scene: VideoScene, *, num_frames: int, resolution: int,
                 rng: random.Random) -> list[list[PlacedObject]]:
    """The objects of every frame: a motion shifts the layout by ``motion_step`` a frame; a colour change holds it
    still and switches the colour at ``change_frame``."""
    if scene.change is not None:
        start = place_objects(Scene(groups=scene.groups), resolution=resolution, rng=rng)
        turned = [dataclasses.replace(o, color=scene.change) for o in start]
        return [start if f < change_frame(num_frames) else turned for f in range(num_frames)]
    step = motion_step(resolution, num_frames)
    first = _moving_layout(scene, resolution, step * (num_frames - 1), rng)
    ux, uy = DIRECTIONS[scene.motion]
    return [_shifted(first, f * step * ux, f * step * uy) for f in range(num_frames)]


def render_clip(scene: VideoScene, *, num_frames: int = 5, resolution: int = 32, rng: random.Random | int = 0,
                supersample: int = 1) -> np.ndarray:
    """A ground-truth uint8 [F, H, W, 3] clip matching ``scene``; deterministic in ``rng``."""
    if resolution < 16:
        raise ValueError(f"ShapeEval resolution must be >= 16, got {resolution}")
    rng = rng if isinstance(rng, random.Random) else random.Random(rng)
    frames = clip_objects(scene, num_frames=num_frames, resolution=resolution, rng=rng)
    return np.stack([render_objects(objs, resolution=resolution, supersample=supersample) for objs in frames])


def render_video_prompts(prompts: list[str], *, num_frames: int = 5, resolution: int = 32, seed: int = 0,
                         supersample: int = 1) -> np.ndarray:
    """Ground-truth clips for prompts, uint8 [B, F, H, W, 3]; deterministic in ``seed``."""
    rng = random.Random(seed)
    return np.stack([render_clip(parse_video_prompt(p), num_frames=num_frames, resolution=resolution, rng=rng,
                                 supersample=supersample) for p in prompts])


def _recolored(scene: VideoScene, rng: random.Random) -> VideoScene:
    i = rng.randrange(len(scene.groups))
    taken = {g.color for g in scene.groups} | {scene.change}
    groups = list(scene.groups)
    groups[i] = dataclasses.replace(groups[i], color=rng.choice([c for c in PALETTE if c not in taken]))
    return dataclasses.replace(scene, groups=tuple(groups))


def corrupt_clip(scene: VideoScene, kind: str, *, num_frames: int = 5, resolution: int = 32,
                 rng: random.Random, supersample: int = 1) -> np.ndarray | None:
    """A clip that must fail ``scene.prompt``, changed in one way (``CLIP_CORRUPTIONS``); None where the kind
    does not change what the prompt asks (a dropped frame of a colour change, which holds still, or of a
    two-frame clip)."""
    if kind not in CLIP_CORRUPTIONS:
        raise ValueError(f"unknown clip corruption: {kind!r} (known: {', '.join(CLIP_CORRUPTIONS)})")
    if kind == "drop" and (scene.change is not None or num_frames < 3):
        return None
    if kind == "color":
        return render_clip(_recolored(scene, rng), num_frames=num_frames, resolution=resolution, rng=rng,
                           supersample=supersample)
    clip = render_clip(scene, num_frames=num_frames, resolution=resolution, rng=rng, supersample=supersample)
    if kind == "reverse":
        return clip[::-1].copy()
    if kind == "static":
        return np.repeat(clip[:1], num_frames, axis=0)
    k = rng.randrange(1, num_frames - 1) if num_frames > 2 else 1  # never the first frame
    if kind == "drop":
        return np.concatenate([clip[:k], clip[k + 1:], clip[-1:]])
    clip[k] = np.array(BACKGROUND, dtype=np.uint8)  # replace
    return clip
