"""ShapeEval folder evaluation (file-name and manifest formats, bad input). Needs: CPU, 1 process."""
import json

import pytest
from PIL import Image

from megaflow.shapeeval.render import render_prompts
from megaflow.data.shapes import sample_prompts
from megaflow.shapeeval.score import evaluate_ground_truth, evaluate_images, prompt_from_filename


def _write(dirpath, prompts, images, *, manifest: bool):
    dirpath.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (p, im) in enumerate(zip(prompts, images)):
        name = f"img{i}.png" if manifest else f"{i:04d}-{p.replace(' ', '_')}.png"
        Image.fromarray(im).save(dirpath / name)
        rows.append({"file": name, "prompt": p})
    if manifest:
        (dirpath / "manifest.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_folder_formats_agree_and_catch_wrong_images(tmp_path):
    prompts = sample_prompts("eval", 14, seed=0)
    good = render_prompts(prompts, resolution=32, seed=0)
    _write(tmp_path / "names", prompts, good, manifest=False)
    _write(tmp_path / "manifest", prompts, good, manifest=True)
    by_name = evaluate_images(tmp_path / "names", details=True)
    by_manifest = evaluate_images(tmp_path / "manifest")
    assert by_name["accuracy"] == by_manifest["accuracy"] == 1.0 and by_name["num"] == 14
    assert [s["prompt"] for s in by_name["samples"]] == prompts
    json.dumps(by_name)  # JSON-able
    # Shuffle images against prompts: most must now fail.
    _write(tmp_path / "shuffled", prompts, good[::-1].copy(), manifest=True)
    assert evaluate_images(tmp_path / "shuffled")["accuracy"] < 0.5


def test_prompt_from_filename():
    from pathlib import Path
    assert prompt_from_filename(Path("0007-two_red_circles_left_of_a_blue_square.png")) == \
        "two red circles left of a blue square"
    assert prompt_from_filename(Path("12_a_circle.jpg")) == "a circle"
    assert prompt_from_filename(Path("a_circle.png")) == "a circle"


def test_bad_inputs_raise_value_errors_naming_them(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        evaluate_images(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no images"):
        evaluate_images(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "0001-a_circle.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match="0001-a_circle.png"):
        evaluate_images(bad)
    noprompt = tmp_path / "noprompt"
    noprompt.mkdir()
    Image.new("RGB", (32, 32), "white").save(noprompt / "0001-hello.png")
    with pytest.raises(ValueError, match="0001-hello.png"):
        evaluate_images(noprompt)
    badman = tmp_path / "badman"
    badman.mkdir()
    (badman / "manifest.jsonl").write_text('{"file": "x.png"}\n')
    with pytest.raises(ValueError, match="line 1"):
        evaluate_images(badman)
    missing_file = tmp_path / "missing_file"
    missing_file.mkdir()
    (missing_file / "manifest.jsonl").write_text('{"file": "x.png", "prompt": "a circle"}\n')
    with pytest.raises(ValueError, match="x.png"):
        evaluate_images(missing_file)
    with pytest.raises(ValueError, match="num"):
        evaluate_ground_truth(0)


def test_ground_truth_result_is_deterministic():
    a, b = evaluate_ground_truth(14, seed=3), evaluate_ground_truth(14, seed=3)
    assert a == b and {"accuracy", "num", "per_category", "partial_mean"} <= set(a)


def test_transparency_is_background_large_images_are_downscaled_and_manifest_stays_inside(tmp_path):
    """A fully transparent RGBA image whose hidden RGB is a perfect render scores 0 (blank), a 2000 px
    upscale of a render still passes (downscaled first), a manifest entry outside the folder is refused."""
    import json

    import numpy as np
    from PIL import Image

    from megaflow.shapeeval.render import render_prompts
    from megaflow.shapeeval.score import evaluate_images
    prompt = "a red circle left of a blue square"
    img = render_prompts([prompt], resolution=32, seed=0)[0]
    rgba = np.concatenate([img, np.zeros((32, 32, 1), np.uint8)], axis=-1)
    Image.fromarray(rgba, "RGBA").save(tmp_path / "0000-a_red_circle_left_of_a_blue_square.png")
    assert evaluate_images(tmp_path)["accuracy"] == 0.0
    big = tmp_path / "big"
    big.mkdir()
    Image.fromarray(img).resize((2000, 2000), Image.NEAREST).save(big / "0000-a_red_circle_left_of_a_blue_square.png")
    assert evaluate_images(big)["accuracy"] == 1.0
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "manifest.jsonl").write_text(json.dumps({"file": "../big/0000-a_red_circle_left_of_a_blue_square.png",
                                                     "prompt": prompt}) + "\n")
    with pytest.raises(ValueError, match="outside the folder"):
        evaluate_images(evil)
