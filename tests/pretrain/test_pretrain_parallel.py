"""``megaflow pretrain`` at TP=2 and at PP=2 (2 gloo ranks under torchrun; PP includes the evaluation
sampler, whose velocities come from the last stage) trains the same DiT as one rank: the data,
init and schedule are seeded, so after a few steps the saved EMA weights agree to fp32 reduction-order
noise (atol 1e-5; the updates are ~1e-3 per entry and per step). Needs: CPU, torchrun with 2 processes (~1.5 min)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.dist]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TINY = ["pretrain.text_steps=3", "pretrain.vae_steps=3", "pretrain.num_images=128", "pretrain.max_steps=4",
        "pretrain.eval_every=4", "pretrain.eval_prompts=5", "pretrain.num_layers=2", "pretrain.num_heads=2",
        "pretrain.head_dim=16", "pretrain.batch_size=8", "pretrain.ema_decay=0.5", "pretrain.warmup_steps=0"]


def _pretrain(out: Path, name: str, nproc: int, *extra: str) -> Path:
    args = ["pretrain", "-c", "configs/shapes_pretrain.toml"]
    for s in [*TINY, f"run.output_dir='{out}'", f"run.name='{name}'", *extra]:
        args += ["--set", s]
    cmd = ([sys.executable, "-m", "megaflow.cli"] if nproc == 1 else
           [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(nproc), "-m", "megaflow.cli"]) + args
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return out / name / "pipeline" / "transformer"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from safetensors.torch import load_file
    return load_file(str(next(_pretrain(tmp_path_factory.mktemp("ref"), "one", 1).glob("*.safetensors"))))


@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.pp=2"])
def test_pretrain_on_two_ranks_equals_one(reference, layout, tmp_path):
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import load_file

    from megaflow.models.sd3.shapes import transformer_config
    one = reference
    two = load_file(str(next(_pretrain(tmp_path, "two", 2, layout).glob("*.safetensors"))))
    torch.manual_seed(0)  # the init ``assemble`` draws (run.seed 0)
    init = SD3Transformer2DModel(**transformer_config(resolution=32, num_layers=2, num_heads=2, head_dim=16)).state_dict()
    moved = max(float((one[k] - init[k]).abs().max()) for k in one if k in init)
    assert moved > 1e-3, "training did not move the weights: the comparison below would be vacuous"
    assert one.keys() == two.keys()
    for k in one:
        torch.testing.assert_close(two[k], one[k], atol=1e-5, rtol=1e-4, msg=k)
