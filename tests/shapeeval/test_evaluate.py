"""Engine-sampled ShapeEval: prompt sets, Wilson intervals, scoring and the saved image folder. Needs: CPU, 1 process."""
import torch

from megaflow.shapeeval.render import render_prompts
from megaflow.data.shapes import HELD_OUT_CATEGORIES, SEEN_CATEGORIES, category_of, parse_prompt
from megaflow.shapeeval.evaluate import ci95, eval_prompts, save_images, score
from megaflow.shapeeval.score import evaluate_images


def test_wilson_interval_matches_the_textbook_value():
    lo, hi = ci95(0.5, 100)  # Wilson: 0.5 +- 0.0962 (z = 1.96)
    assert abs(lo - 0.4038) < 1e-3 and abs(hi - 0.5962) < 1e-3
    assert abs(ci95(0.0, 300)[0]) < 1e-12 and abs(ci95(1.0, 300)[1] - 1.0) < 1e-12


def test_prompt_set_is_fixed_and_split_by_category():
    held, seen = eval_prompts(300, 60, seed=0)
    assert (held, seen) == eval_prompts(300, 60, seed=0)
    assert len(held) == 300 and len(seen) == 60
    assert {category_of(parse_prompt(p)) for p in held} == set(HELD_OUT_CATEGORIES)
    assert {category_of(parse_prompt(p)) for p in seen} == set(SEEN_CATEGORIES)


def test_score_ground_truth_and_blank_and_rescore_saved_folder(tmp_path):
    held, _ = eval_prompts(25, 0, seed=1)
    gt = torch.from_numpy(render_prompts(held, resolution=32, seed=3)).permute(0, 3, 1, 2).float() / 255
    res = score(gt, held)
    assert res["accuracy"] == 1.0 and res["num"] == 25 and res["ci95"][0] > 0.8
    assert score(torch.ones_like(gt), held)["accuracy"] == 0.0
    save_images(gt, held, tmp_path)
    assert (tmp_path / "grid.png").is_file()
    assert evaluate_images(tmp_path)["accuracy"] == 1.0
