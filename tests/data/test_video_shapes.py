"""Video ShapeEval's grammar and splits (megaflow.data.video_shapes). Needs: CPU, 1 process (~2 s).

Every prompt of every category parses back into its scene; TRAIN and held-out are disjoint, cover the universe,
are the same on every call and follow the image split's rule (every word of a held-out prompt is in TRAIN)."""
from __future__ import annotations

import pytest

from megaflow.data import video_shapes as V
from megaflow.data.shapes import PALETTE, SHAPES

SIZES = {"motion": (48, 24), "count_motion": (108, 36), "position_motion": (2160, 720), "color_change": (60, 30)}


def test_every_prompt_parses_back():
    for cat in V.VIDEO_CATEGORIES:
        for scene in V._video_universe(cat):
            back = V.parse_video_prompt(scene.prompt)
            assert back == scene and V.video_category_of(back) == cat, scene.prompt
    assert V.parse_video_prompt("  A red circle  moving LEFT. ") == V.VideoScene(
        groups=(V.Group(shape="circle", color="red"),), motion="left")


@pytest.mark.parametrize("prompt", [
    "a red circle moving sideways", "two red circle moving up", "a red circle turning red", "a circle turning blue",
    "two red circles turning blue", "a red circle above a red circle, both moving up", "a red circle moving",
    "two red circles above a blue square, both moving up", "a red circle left of a blue square", ""])
def test_prompts_outside_the_grammar_are_refused_in_one_line(prompt):
    with pytest.raises(ValueError, match="not a video ShapeEval prompt") as e:
        V.parse_video_prompt(prompt)
    assert "\n" not in str(e.value)


def test_splits_are_disjoint_complete_and_deterministic():
    split = V.split_video_prompts()
    assert split == V.split_video_prompts(seed=0)
    assert split["eval"] != V.split_video_prompts(seed=1)["eval"]
    for cat in V.VIDEO_CATEGORIES:
        train, held = split["train"][cat], split["eval"][cat]
        assert (len(train), len(held)) == SIZES[cat]
        assert not set(train) & set(held)
        assert set(train) | set(held) == set(V._video_universe(cat))
        prompts = {s.prompt for s in train}
        assert not prompts & {s.prompt for s in held}


def test_held_out_prompts_are_new_combinations_of_trained_words():
    split = V.split_video_prompts()
    for cat in V.VIDEO_CATEGORIES:
        seen = set().union(*(V._video_attributes(s) for s in split["train"][cat]))
        for scene in split["eval"][cat]:
            assert V._video_attributes(scene) <= seen, scene.prompt
    # every colour, shape and direction is trained on in every category that uses it
    motion_train = split["train"]["motion"]
    assert {s.groups[0].color for s in motion_train} == set(PALETTE)
    assert {s.groups[0].shape for s in motion_train} == set(SHAPES)
    assert {s.motion for s in motion_train} == set(V.DIRECTIONS)
    assert {s.change for s in split["train"]["color_change"]} == set(PALETTE)


def test_samples_are_balanced_and_from_their_split():
    split = V.split_video_prompts()
    for name in ("train", "eval"):
        scenes = V.sample_video_scenes(name, 40, seed=3)
        assert scenes == V.sample_video_scenes(name, 40, seed=3)
        cats = [V.video_category_of(s) for s in scenes]
        assert all(cats.count(c) == 10 for c in V.VIDEO_CATEGORIES)
        assert all(s in split[name][V.video_category_of(s)] for s in scenes)
    assert V.sample_video_prompts("eval", 8, seed=0) != V.sample_video_prompts("eval", 8, seed=1)
    with pytest.raises(ValueError, match="unknown video ShapeEval category"):
        V.sample_video_scenes("eval", 4, categories=("colors",))
    with pytest.raises(ValueError, match="split must be"):
        V.sample_video_scenes("test", 4)

