"""The shipped ShapeEval model (assets/shapeeval-sd3): diffusers loads it, its VAE round-trips held-out
ground truth faithfully (checker accuracy >= 0.98 on 300 renders), it declares its prompt length, and its
files match the sha256 sums in its recipe. Needs: CPU, 1 process (~10 s)."""
import hashlib
import json
import re
from pathlib import Path

import torch

from megaflow.shapeeval.render import render_prompts
from megaflow.shapeeval.evaluate import eval_prompts, score
from megaflow.pretrain.vae import decode, encode

ASSET = Path(__file__).resolve().parents[2] / "assets" / "shapeeval-sd3"


def test_shipped_pipeline_loads_and_its_vae_round_trips_held_out_ground_truth():
    from diffusers import StableDiffusion3Pipeline
    pipe = StableDiffusion3Pipeline.from_pretrained(ASSET)
    assert json.loads((ASSET / "megaflow.json").read_text())["max_sequence_length"] == 12
    held, _ = eval_prompts(300, 0, seed=0)
    images = render_prompts(held, resolution=32, seed=11)
    recon = decode(pipe.vae, encode(pipe.vae, images))
    assert score(recon, held)["accuracy"] >= 0.98
    gt = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
    assert score(gt, held)["accuracy"] == 1.0


def test_shipped_files_match_the_recipe_checksums():
    recipe = (ASSET / "RECIPE.md").read_text()
    sums = dict((path, digest) for digest, path in re.findall(r"^([0-9a-f]{64})  (\S+)$", recipe, flags=re.M))
    assert sums, "RECIPE.md lists no sha256 sums"
    for path, digest in sums.items():
        assert hashlib.sha256((ASSET / path).read_bytes()).hexdigest() == digest, path
    weights = {str(p.relative_to(ASSET)) for p in ASSET.rglob("*.safetensors")}
    assert weights <= set(sums)
