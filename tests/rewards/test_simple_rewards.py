"""JPEG, colour-target and ShapeEval rewards give sensible orderings; image forms agree.
Needs: CPU, 1 process."""
import numpy as np
import pytest
import torch
from PIL import Image

from megaflow.shapeeval.render import render_prompts
from megaflow.data.shapes import sample_prompts
from megaflow.rewards import build_reward, safe_score, to_float, to_pil, to_uint8
from megaflow.rewards.color import parse_color

torch.set_num_threads(1)


def _images():
    """[smooth gradient, mid-detail checker, uniform noise] as float [3, 3, 32, 32]."""
    g = torch.Generator().manual_seed(0)
    ramp = torch.linspace(0, 1, 32)
    smooth = torch.stack([ramp[None, :].expand(32, 32), ramp[:, None].expand(32, 32), torch.full((32, 32), 0.5)])
    checker = ((torch.arange(32)[:, None] // 4 + torch.arange(32)[None] // 4) % 2).float().expand(3, 32, 32)
    noise = torch.rand(3, 32, 32, generator=g)
    return torch.stack([smooth, checker, noise])


def test_image_forms_round_trip():
    x = _images()
    u8 = to_uint8(x)
    assert u8.shape == (3, 32, 32, 3) and u8.dtype == np.uint8
    assert torch.allclose(to_float(to_pil(x)), to_float(u8)) and (to_float(u8) - x).abs().max() <= 0.5 / 255 + 1e-6
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        to_uint8(torch.zeros(2, 4, 8, 8))


def test_jpeg_rewards_order_by_detail_and_agree_across_forms():
    x, prompts = _images(), ["x"] * 3
    comp = build_reward("jpeg_compressibility")(x, prompts)
    incomp = build_reward("jpeg_incompressibility")(x, prompts)
    assert comp[0] > comp[1] > comp[2]  # smooth compresses best, noise worst
    assert torch.equal(incomp, -comp) and (incomp > 0).all()
    assert torch.equal(build_reward("jpeg_compressibility")(to_pil(x), prompts), comp)
    assert torch.equal(build_reward("jpeg_compressibility")(to_uint8(x), prompts), comp)
    assert incomp[2] > 1.0  # 32x32 noise at q95 is > 1 kB


def test_color_target_orders_by_distance_and_reads_the_prompt():
    red, pink, blue = (torch.tensor(parse_color(c))[:, None, None].expand(3, 16, 16) for c in ("red", "pink", "blue"))
    x = torch.stack([red, pink, blue])
    fixed = build_reward("color_target", target="red")(x, ["", "", ""])
    assert fixed[0] == pytest.approx(1.0) and fixed[0] > fixed[1] > fixed[2] >= 0.0
    from_prompt = build_reward("color_target")(x, ["a red circle"] * 3)
    assert torch.allclose(from_prompt, fixed)
    per_prompt = build_reward("color_target")(x, ["red", "pink", "blue"])
    assert torch.allclose(per_prompt, torch.ones(3))
    assert build_reward("color_target", target=(1.0, 0.0, 0.0))(x, ["", "", ""])[0] > fixed[2]
    # No colour named in a prompt: only that sample is masked.
    out = safe_score(build_reward("color_target"), x, ["red", "a circle", "blue"])
    assert torch.isnan(out[1]) and torch.isfinite(out[[0, 2]]).all()
    with pytest.raises(ValueError, match="colour"):
        build_reward("color_target", target="chartreuse")


def test_shapeeval_reward_ranks_ground_truth_over_mismatched_images():
    prompts = sample_prompts("eval", 14, seed=4)
    good = render_prompts(prompts, resolution=32, seed=1)
    shuffled = good[::-1].copy()
    exact, graded = build_reward("shapeeval"), build_reward("shapeeval_partial")
    x = torch.from_numpy(good).permute(0, 3, 1, 2).float() / 255
    assert torch.equal(exact(x, prompts), torch.ones(14))
    assert torch.equal(graded(list(map(Image.fromarray, good)), prompts), torch.ones(14))
    wrong_exact, wrong_graded = exact(shuffled, prompts), graded(shuffled, prompts)
    assert wrong_exact.mean() < 0.5 and ((wrong_graded >= 0) & (wrong_graded <= 1)).all()
    assert (wrong_graded >= wrong_exact).all() and wrong_graded.mean() > wrong_exact.mean()
