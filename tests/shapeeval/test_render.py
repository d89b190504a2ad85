"""ShapeEval ground-truth renderer and corruptions. Needs: CPU, 1 process."""
import random

import numpy as np
import pytest

from megaflow.shapeeval.render import (CORRUPTIONS, corrupt_scene, place_objects, render_prompts, render_scene,
                                        size_range)
from megaflow.data.shapes import BACKGROUND, CATEGORIES, MAX_COUNT, PALETTE, parse_prompt, sample_scenes


@pytest.mark.parametrize("resolution", [32, 64])
def test_render_is_deterministic_with_clear_border_and_palette_colours(resolution):
    prompts = [s.prompt for s in sample_scenes("train", 14, seed=2)]
    a = render_prompts(prompts, resolution=resolution, seed=3)
    assert a.shape == (14, resolution, resolution, 3) and a.dtype == np.uint8
    np.testing.assert_array_equal(a, render_prompts(prompts, resolution=resolution, seed=3))
    assert not np.array_equal(a, render_prompts(prompts, resolution=resolution, seed=4))
    border = np.concatenate([a[:, 0], a[:, -1], a[:, :, 0], a[:, :, -1]], axis=1)
    assert (border == np.array(BACKGROUND)).all()
    allowed = {tuple(BACKGROUND)} | set(PALETTE.values())
    assert {tuple(p) for p in a.reshape(-1, 3)} <= allowed  # hard edges: no blends


def test_layout_matches_the_scene():
    rng = random.Random(0)
    for scene in sample_scenes("eval", 70, seed=1):
        objs = place_objects(scene, resolution=32, rng=rng)
        assert len(objs) == scene.num_objects
        lo, hi = size_range(32, scene.num_objects)
        for obj in objs:
            group = scene.groups[obj.group]
            assert obj.shape == group.shape and lo <= obj.size <= hi
            assert group.color in (None, obj.color)
            assert 1 <= obj.x0 and obj.x0 + obj.size <= 31 and 1 <= obj.y0 and obj.y0 + obj.size <= 31


def test_supersampled_render_blends_edges():
    img = render_scene(parse_prompt("a red circle"), resolution=32, rng=0, supersample=4)
    allowed = {tuple(BACKGROUND)} | set(PALETTE.values())
    assert {tuple(p) for p in img.reshape(-1, 3)} - allowed, "expected anti-aliased edge pixels"


def test_bad_resolution_and_shape_raise():
    with pytest.raises(ValueError, match="resolution"):
        render_scene(parse_prompt("a circle"), resolution=8)
    with pytest.raises(ValueError, match="corruption"):
        corrupt_scene(parse_prompt("a circle"), "blur", random.Random(0))


def test_corruptions_change_exactly_the_named_attribute():
    rng = random.Random(0)
    seen = {k: 0 for k in CORRUPTIONS}
    for scene in sample_scenes("eval", 7 * 20, seed=0, categories=CATEGORIES):
        for kind in CORRUPTIONS:
            bad = corrupt_scene(scene, kind, rng)
            if bad is None:
                assert (kind == "color" and all(g.color is None for g in scene.groups)) or \
                       (kind == "position" and scene.relation is None)
                continue
            seen[kind] += 1
            assert bad != scene
            pairs = list(zip(scene.groups, bad.groups))
            if kind == "color":
                assert any(a.color != b.color for a, b in pairs) and bad.relation == scene.relation
            elif kind == "count":
                assert sum(abs(a.count - b.count) for a, b in pairs) == 1
                assert 1 <= min(g.count for g in bad.groups) and bad.num_objects <= MAX_COUNT
            elif kind == "position":
                assert bad.groups == scene.groups and bad.relation != scene.relation
            else:
                assert any(a.shape != b.shape for a, b in pairs)
            render_scene(bad, resolution=32, rng=rng)  # every corruption stays renderable
    assert all(n > 10 for n in seen.values()), seen
