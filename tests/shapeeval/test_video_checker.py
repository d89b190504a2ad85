"""Video ShapeEval's renderer and checker. Needs: CPU, 1 process (~15 s).

Ground-truth clips pass (strict 1.0) on every category over many seeds, frame counts and resolutions, with every
object inside the canvas in every frame and the tracked motion equal to the renderer's own shift (1e-9 px); each
corruption fails every clip it applies to and scores lower; the clause rules on hand-made tracks match their
written definitions."""
from __future__ import annotations

import random

import numpy as np
import pytest

from megaflow.data.shapes import BACKGROUND
from megaflow.data.video_shapes import VIDEO_CATEGORIES, parse_video_prompt, sample_video_scenes, video_category_of
from megaflow.shapeeval import CLIP_CORRUPTIONS
from megaflow.shapeeval.checker import DetectedObject, detect_objects
from megaflow.shapeeval.video_checker import (MIN_TRAVEL, change_score, link_tracks, motion_score, score_clip)
from megaflow.shapeeval.video_render import clip_objects, corrupt_clip, motion_step, render_clip
from megaflow.shapeeval.video_score import evaluate_video_corruption, evaluate_video_ground_truth


@pytest.mark.parametrize("frames, resolution, supersample", [(5, 32, 1), (9, 32, 1), (2, 32, 1), (5, 64, 4)])
def test_ground_truth_passes_on_every_category(frames, resolution, supersample):
    num = 24 if supersample > 1 else 100
    for split in ("eval", "train"):
        out = evaluate_video_ground_truth(num, num_frames=frames, resolution=resolution, supersample=supersample,
                                          seed=frames + resolution, split=split)
        assert set(out["per_category"]) == set(VIDEO_CATEGORIES)
        assert out["accuracy"] == 1.0 and out["partial_mean"] == 1.0, out["per_category"]


def test_objects_stay_inside_and_move_by_the_step():
    rng = random.Random(0)
    for frames in (3, 5, 9, 12):
        step = motion_step(32, frames)
        assert step >= 1 and step * (frames - 1) >= MIN_TRAVEL * 32
        for scene in sample_video_scenes("train", 24, seed=frames):
            per_frame = clip_objects(scene, num_frames=frames, resolution=32, rng=rng)
            for objs in per_frame:
                assert all(1 <= o.x0 and o.x0 + o.size <= 31 and 1 <= o.y0 and o.y0 + o.size <= 31 for o in objs)
            clip = render_clip(scene, num_frames=frames, resolution=32, rng=random.Random(7))
            tracks = link_tracks([detect_objects(f) for f in clip])
            shift = np.array([0, 0]) if scene.change else step * (frames - 1) * np.array(
                {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}[scene.motion])
            for t in tracks:
                np.testing.assert_allclose(np.subtract(t[-1].centroid, t[0].centroid), shift, atol=1e-9)
    with pytest.raises(ValueError, match="at most 12 frames"):
        motion_step(32, 13)


def test_rendering_is_deterministic():
    scene = parse_video_prompt("two blue squares moving up")
    a, b = render_clip(scene, rng=3), render_clip(scene, rng=3)
    assert a.shape == (5, 32, 32, 3) and a.dtype == np.uint8 and np.array_equal(a, b)
    assert not np.array_equal(a, render_clip(scene, rng=4))


@pytest.mark.parametrize("kind", CLIP_CORRUPTIONS)
def test_every_corruption_fails(kind):
    for frames in (5, 9):
        out = evaluate_video_corruption(kind, 48, num_frames=frames, seed=1)
        want = [c for c in VIDEO_CATEGORIES if not (kind == "drop" and c == "color_change")]
        assert sorted(out["per_category"]) == sorted(want) and out["num"] == 48
        assert out["accuracy"] == 0.0, out["per_category"]
        assert 0.1 < out["partial_mean"] < 0.8 and max(out["per_category_partial"].values()) < 1.0


def test_drop_does_not_apply_to_a_colour_change():
    scene = parse_video_prompt("a red square turning blue")
    assert corrupt_clip(scene, "drop", rng=random.Random(0)) is None
    clip = corrupt_clip(parse_video_prompt("a red square moving up"), "drop", rng=random.Random(0))
    assert clip.shape == (5, 32, 32, 3)


def test_blank_and_noise_clips_fail():
    rng = np.random.default_rng(0)
    for scene in sample_video_scenes("eval", 8, seed=0):
        for clip in (np.full((5, 32, 32, 3), BACKGROUND, np.uint8), rng.integers(0, 256, (5, 32, 32, 3), np.uint8)):
            v = score_clip(clip, scene)
            assert not v.passed and v.partial == 0.0 and v.category == video_category_of(scene)


def _track(points, colors=None) -> list[DetectedObject]:
    colors = colors or ["red"] * len(points)
    return [DetectedObject(color=c, shape="square", area=49, centroid=(float(x), float(y)), bbox=(0, 0, 0, 0))
            for (x, y), c in zip(points, colors)]


@pytest.mark.parametrize("points, direction, want", [
    ([(5, 9), (7, 9), (9, 9), (11, 9), (13, 9)], "right", 1.0),  # 8 px >= 4.8, steady
    ([(13, 9), (11, 9), (9, 9), (7, 9), (5, 9)], "right", 0.0),  # reversed
    ([(5, 9), (5, 9), (5, 9), (5, 9), (5, 9)], "right", 0.0),  # static
    ([(5, 9), (7, 9), (11, 9), (13, 9), (13, 9)], "right", 0.5),  # a frame dropped: moved, not steadily
    ([(5, 9), (6, 9), (7, 9), (8, 9), (9, 9)], "right", 0.5),  # steady but 4 px < 4.8 px
    ([(5, 5), (7, 7), (9, 9), (11, 11), (13, 13)], "right", 0.5),  # steady, drifts down as far as it goes right
    ([(9, 20), (9, 18), (9, 16), (9, 14), (9, 12)], "up", 1.0),
    ([(9, 20), (9, 18), (9, 16), (9, 14), (9, 12)], "down", 0.0),
])
def test_motion_rule(points, direction, want):
    assert motion_score(_track(points), direction, 32) == want


@pytest.mark.parametrize("colors, moved, want", [
    (["red", "red", "blue", "blue", "blue"], 0, 1.0),
    (["blue", "blue", "red", "red", "red"], 0, 0.25),  # reversed: only stays still
    (["red"] * 5, 0, 0.5),  # never turns: starts right, stays still
    (["red", "blue", "red", "blue", "blue"], 0, 0.75),  # flickers
    (["red", "red", "blue", "blue", "blue"], 4, 0.75),  # turns, but moves 4 px > 3.2 px
])
def test_change_rule(colors, moved, want):
    points = [(9 + moved * i / 4, 9) for i in range(5)]
    assert change_score(_track(points, colors), "red", "blue", 32) == want


def test_tracks_link_nearest_and_need_the_same_objects_in_every_frame():
    a, b = _track([(5, 5), (6, 5)]), _track([(20, 20), (21, 20)])
    tracks = link_tracks([[a[0], b[0]], [b[1], a[1]]])
    assert tracks == [[a[0], a[1]], [b[0], b[1]]]
    assert link_tracks([[a[0], b[0]], [a[1]]]) is None and link_tracks([[], []]) is None


@pytest.mark.parametrize("bad", [np.zeros((5, 32, 32), np.uint8), np.zeros((1, 32, 32, 3), np.uint8),
                                 np.zeros((5, 32, 32, 3), np.float32), [[0]]])
def test_bad_arrays_are_refused_in_one_line(bad):
    with pytest.raises(ValueError, match="uint8 clip"):
        score_clip(bad, parse_video_prompt("a red circle moving left"))
