"""Video ShapeEval checker: a clip against its prompt. Every frame goes through the image checker (the prompt's
still scene: the same objects in every frame); each group's objects are tracked frame to frame and the motion or
change clause is judged on the tracks' centroids and colours. Invariant: ``partial`` is 1.0 exactly when the clip
passes. Rules and tolerances: docs/design/video_shapeeval.md.
"""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from megaflow.data.video_shapes import DIRECTIONS, VideoScene, video_category_of
from megaflow.shapeeval.checker import DetectedObject, detect_objects, matches, score_objects

MIN_TRAVEL = 0.15  # a motion moves its object at least this fraction of the side, first frame to last ...
MAX_DRIFT = 0.5  # ... drifting across the direction by at most this fraction of the way it went along it ...
STEADY = 0.5  # ... and every frame-to-frame step along it is within this fraction of the mean step of it
STILL = 0.1  # a colour change keeps its object within this fraction of the side of where it started


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClipScore:
    """Verdict on one clip: exact pass, partial score in [0, 1] (half the frames' mean image partial score, half
    the clause's), the category, and the two halves."""

    passed: bool
    partial: float
    category: str
    frames: float  # mean image partial score over the frames
    clause: float  # the clause's score: tracked objects doing what the prompt says


def link_tracks(per_frame: list[list[DetectedObject]]) -> list[list[DetectedObject]] | None:
    """Each object's track through the frames, linking each frame's objects to the next frame's by the smallest
    total squared centroid distance; None when some frame has none or frames disagree on how many there are."""
    n = len(per_frame[0])
    if n == 0 or any(len(objs) != n for objs in per_frame):
        return None
    tracks = [[o] for o in per_frame[0]]
    for objs in per_frame[1:]:
        last = np.array([t[-1].centroid for t in tracks])
        cost = lambda perm: float(((last - np.array([objs[j].centroid for j in perm])) ** 2).sum())  # noqa: E731
        best = min(itertools.permutations(range(n)), key=cost)
        for t, j in zip(tracks, best):
            t.append(objs[j])
    return tracks


def motion_score(track: list[DetectedObject], direction: str, resolution: int) -> float:
    """Half for having moved (``MIN_TRAVEL`` along ``direction``, ``MAX_DRIFT`` across it), half for moving
    steadily (every step along the direction within ``STEADY`` of the mean step, which is positive)."""
    ux, uy = DIRECTIONS[direction]
    steps = np.diff(np.array([o.centroid for o in track]), axis=0)  # [F - 1, 2] (dx, dy)
    along, across = steps @ np.array([ux, uy]), steps @ np.array([abs(uy), abs(ux)])
    went, drift = float(along.sum()), abs(float(across.sum()))
    moved = went >= MIN_TRAVEL * resolution and drift <= MAX_DRIFT * went
    mean = went / len(steps)
    steady = mean > 0 and bool(np.all(np.abs(along - mean) <= STEADY * mean))
    return 0.5 * moved + 0.5 * steady


def change_score(track: list[DetectedObject], start: str, end: str, resolution: int) -> float:
    """A quarter each: the first frame in ``start``, the last in ``end``, one switch (``start`` ... then ``end``
    ..., nothing else), the object within ``STILL`` of the side of where it started."""
    colors = [o.color for o in track]
    k = next((i for i, c in enumerate(colors) if c != start), len(colors))
    one_switch = 0 < k < len(colors) and all(c == end for c in colors[k:])
    c = np.array([o.centroid for o in track])
    still = float(np.linalg.norm(c - c[0], axis=-1).max()) <= STILL * resolution
    return (float(colors[0] == start) + float(colors[-1] == end) + float(one_switch) + float(still)) / 4


def _clause(per_frame: list[list[DetectedObject]], scene: VideoScene, resolution: int) -> float:
    """Mean over groups of the tracks' scores over max(tracks, the group's count); a group not trackable scores 0."""
    parts = []
    for g, still in zip(scene.groups, scene.scene.groups):
        tracks = link_tracks([[o for o in objs if matches(o, still)] for objs in per_frame])
        if tracks is None:
            parts.append(0.0)
            continue
        if scene.change is not None:
            scores = [change_score(t, g.color, scene.change, resolution) for t in tracks]
        else:
            scores = [motion_score(t, scene.motion, resolution) for t in tracks]
        parts.append(sum(scores) / max(len(tracks), g.count))
    return float(np.mean(parts))


def check_clip_array(frames: np.ndarray) -> None:
    """ValueError (one line) unless ``frames`` is a uint8 clip [F, H, W, 3] with F >= 2."""
    if not (isinstance(frames, np.ndarray) and frames.dtype == np.uint8 and frames.ndim == 4
            and frames.shape[-1] == 3 and frames.shape[0] >= 2):
        got = f"{frames.dtype} {tuple(frames.shape)}" if isinstance(frames, np.ndarray) else type(frames).__name__
        raise ValueError(f"video ShapeEval wants a uint8 clip [F >= 2, H, W, 3], got {got}")


def score_clip(frames: np.ndarray, scene: VideoScene, **detect_kwargs) -> ClipScore:
    """Judge a uint8 clip [F, H, W, 3] against ``scene`` (see the module docstring)."""
    check_clip_array(frames)
    resolution = min(frames.shape[1:3])
    per_frame = [detect_objects(f, **detect_kwargs) for f in frames]
    verdicts = [score_objects(objs, scene.scene, resolution) for objs in per_frame]
    frames_part = float(np.mean([v.partial for v in verdicts]))
    clause = _clause(per_frame, scene, resolution)
    passed = all(v.passed for v in verdicts) and clause == 1.0
    partial = 0.5 * frames_part + 0.5 * clause
    assert passed == (partial == 1.0), "partial is 1.0 exactly when the clip passes"
    return ClipScore(passed=passed, partial=partial, category=video_category_of(scene), frames=frames_part,
                     clause=clause)

