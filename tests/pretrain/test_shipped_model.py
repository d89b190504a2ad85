"""The shipped ShapeEval model (assets/shapeeval-sd3): diffusers loads it, its VAE round-trips held-out
ground truth faithfully (checker accuracy >= 0.98 on 300 renders), it declares its prompt length, and its
files match the sha256 sums in its recipe; ``megaflow eval shapes --sampler diffusers`` (diffusers' own sampling, no
engine) scores it well above an untrained model (held-out 0.53-0.57 on 300 prompts; here >= 0.3 on 60, whose
95% interval at 0.53 reaches down to 0.41). Needs: CPU, 1 process (~1 min)."""
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megaflow.shapeeval.render import render_prompts
from megaflow.shapeeval.evaluate import eval_prompts, score
from megaflow.models.sd3.shapes import decode, encode
from megaflow.pretrain.vae import to_pixels

ASSETS = Path(__file__).resolve().parents[2] / "assets"
ASSET = ASSETS / "shapeeval-sd3"


def test_shipped_pipeline_loads_and_its_vae_round_trips_held_out_ground_truth():
    from diffusers import StableDiffusion3Pipeline
    pipe = StableDiffusion3Pipeline.from_pretrained(ASSET)
    assert json.loads((ASSET / "megaflow.json").read_text())["max_sequence_length"] == 12
    held, _ = eval_prompts(300, 0, seed=0)
    images = render_prompts(held, resolution=32, seed=11)
    recon = decode(pipe.vae, encode(pipe.vae, to_pixels(images)))
    assert score(recon, held)["accuracy"] >= 0.98
    gt = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    assert score(gt, held)["accuracy"] == 1.0


@pytest.mark.parametrize("name", ["shapeeval-sd3", "shapeeval-qwen-image"])
def test_shipped_files_match_the_recipe_checksums(name):
    asset = ASSETS / name
    recipe = (asset / "RECIPE.md").read_text()
    sums = dict((path, digest) for digest, path in re.findall(r"^([0-9a-f]{64})  (\S+)$", recipe, flags=re.M))
    assert sums, "RECIPE.md lists no sha256 sums"
    for path, digest in sums.items():
        assert hashlib.sha256((asset / path).read_bytes()).hexdigest() == digest, path
    weights = {str(p.relative_to(asset)) for p in asset.rglob("*.safetensors")}
    assert weights <= set(sums)


@pytest.mark.slow
def test_eval_shapes_with_the_diffusers_sampler(tmp_path):
    out = tmp_path / "eval"
    cmd = [sys.executable, "-m", "megaflow.cli", "eval", "shapes", "--pipeline", str(ASSET), "--sampler", "diffusers",
           "--num", "60", "--num-seen", "0", "--seed", "3", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    result = json.loads(res.stdout)
    assert result["sampler"] == "diffusers" and result["num"] == 60
    assert result["accuracy"] >= 0.3, result["per_category"]
    assert len((out / "manifest.jsonl").read_text().splitlines()) == 60 and (out / "grid.png").is_file()


def test_shipped_qwen_image_vae_round_trips_held_out_ground_truth():
    """The Qwen-Image model's VAE keeps what ShapeEval checks: its reconstructions of held-out ground truth pass."""
    from diffusers import AutoencoderKLQwenImage

    from megaflow.models.qwen_image import shapes as kit
    vae = AutoencoderKLQwenImage.from_pretrained(ASSETS / "shapeeval-qwen-image" / "vae")
    held, _ = eval_prompts(100, 0, seed=0)
    images = render_prompts(held, resolution=32, seed=11)
    assert score(kit.decode(vae, kit.encode(vae, to_pixels(images))), held)["accuracy"] >= 0.95
