"""ShapeEval pixel checker: ground truth passes, blanks/noise and every corruption fail.
Needs: CPU, 1 process (~6 s)."""
import numpy as np
import pytest

from megaflow.shapeeval.render import CORRUPTIONS, PlacedObject, render_objects
from megaflow.data.shapes import CATEGORIES, parse_prompt, sample_scenes
from megaflow.shapeeval.checker import detect_objects, score_image
from megaflow.shapeeval.score import evaluate_corruption, evaluate_ground_truth, summarize


@pytest.mark.parametrize("resolution, supersample", [(32, 1), (64, 4)])
def test_ground_truth_passes(resolution, supersample):
    out = evaluate_ground_truth(210, seed=0, resolution=resolution, supersample=supersample)
    assert out["num"] == 210 and set(out["per_category"]) == set(CATEGORIES)
    assert out["accuracy"] >= 0.99 and out["partial_mean"] >= 0.99
    assert min(out["per_category"].values()) >= 0.95, out["per_category"]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_every_corruption_is_caught(kind):
    out = evaluate_corruption(kind, 100, seed=1, resolution=32)
    assert out["num"] == 100
    assert out["accuracy"] <= 0.02, out
    assert out["partial_mean"] < 0.8  # graded score drops too, but stays informative
    assert out["partial_mean"] > 0.1


def test_blank_and_noise_images_fail():
    rng = np.random.default_rng(0)
    scenes = sample_scenes("eval", 70, seed=2)
    images = {
        "blank": lambda: np.full((32, 32, 3), 255, np.uint8),
        "grey": lambda: np.full((32, 32, 3), 128, np.uint8),
        "noise": lambda: rng.integers(0, 256, (32, 32, 3), dtype=np.uint8),
        "speckle": lambda: np.where(rng.random((32, 32, 1)) < 0.3, rng.integers(0, 256, (32, 32, 3)), 255
                                    ).astype(np.uint8),
    }
    for name, make in images.items():
        out = summarize([score_image(make(), s) for s in scenes])
        assert out["accuracy"] <= 0.02 and out["partial_mean"] <= 0.05, (name, out)


def test_detects_known_objects():
    objs = [PlacedObject(shape="circle", color="red", group=0, x0=2, y0=2, size=14),
            PlacedObject(shape="square", color="blue", group=1, x0=40, y0=5, size=12),
            PlacedObject(shape="triangle", color="yellow", group=1, x0=20, y0=40, size=16)]
    img = render_objects(objs, resolution=64)
    found = sorted((d.shape, d.color) for d in detect_objects(img))
    assert found == [("circle", "red"), ("square", "blue"), ("triangle", "yellow")]


def test_partial_score_orders_near_misses():
    scene = parse_prompt("two red circles left of a blue square")
    circle = dict(shape="circle", group=0, size=8)
    right = render_objects([PlacedObject(color="red", x0=2, y0=4, **circle),
                            PlacedObject(color="red", x0=2, y0=20, **circle),
                            PlacedObject(shape="square", color="blue", group=1, x0=20, y0=12, size=8)], resolution=32)
    one_missing = render_objects([PlacedObject(color="red", x0=2, y0=4, **circle),
                                  PlacedObject(shape="square", color="blue", group=1, x0=20, y0=12, size=8)],
                                 resolution=32)
    wrong_side = render_objects([PlacedObject(color="red", x0=22, y0=4, **circle),
                                 PlacedObject(color="red", x0=22, y0=20, **circle),
                                 PlacedObject(shape="square", color="blue", group=1, x0=4, y0=12, size=8)],
                                resolution=32)
    s_right, s_missing, s_side = (score_image(im, scene) for im in (right, one_missing, wrong_side))
    blank = score_image(np.full_like(right, 255), scene)
    assert s_right.passed and s_right.partial == 1.0 and s_right.category == "composite"
    assert not s_missing.passed and not s_side.passed and not blank.passed
    assert 1.0 > s_missing.partial > blank.partial == 0.0
    assert 1.0 > s_side.partial > blank.partial


def test_checker_rejects_bad_arrays():
    with pytest.raises(ValueError, match="uint8"):
        detect_objects(np.zeros((32, 32, 3), np.float32))
