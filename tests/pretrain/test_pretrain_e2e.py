"""``megaflow pretrain`` end to end on tiny settings, then the saved pipeline through a real SGLang engine:
the engine's conditioning equals ``encode_prompts`` (hidden states bit-exact, pooled projections to 1 ulp), its latents are 16x16 (the VAE's spatial
factor 2), its decoded images equal the VAE decode of its final latents (1e-5), and ``eval shapes --pipeline``
samples and scores through it. Needs: CPU, 1 process + engine workers (~2 min)."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.engine]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    out = tmp_path_factory.mktemp("pre")
    sets = ["run.name='p'", f"run.output_dir='{out}'", "pretrain.text_steps=20", "pretrain.vae_steps=30",
            "pretrain.num_images=256", "pretrain.max_steps=40", "pretrain.eval_every=20", "pretrain.eval_prompts=10",
            "pretrain.num_layers=1", "pretrain.num_heads=2", "pretrain.head_dim=16", "pretrain.batch_size=16"]
    cmd = [sys.executable, "-m", "megaflow.cli", "pretrain", "-c", "configs/shapes_pretrain.toml", "--json"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "p", json.loads(proc.stdout.strip().splitlines()[-1])


def test_pretrain_writes_history_and_a_loadable_pipeline(pretrained):
    run_dir, last = pretrained
    rows = [json.loads(line) for line in (run_dir / "pretrain.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [20, 40]  # every eval_every steps (the end is one of them)
    assert 0 < rows[-1]["loss"] < 10 and set(last["per_category"]) <= {"colors", "counting", "color_attr", "position",
                                                                    "composite"}
    meta = json.loads((run_dir / "pipeline" / "megaflow.json").read_text())
    assert meta["max_sequence_length"] == 12 and meta["pretrain"]["step"] == 40


def test_engine_conditioning_latents_and_decode_match(pretrained):
    from diffusers import StableDiffusion3Pipeline

    from megaflow.models.sd3.shapes import TEXT_LEN, conditioning, decode
    from megaflow.rollout.sglang import SGLangEngine, SGLangEngineConfig
    from megaflow.rollout.types import RolloutRequest
    pipe_dir = pretrained[0] / "pipeline"
    pipe = StableDiffusion3Pipeline.from_pretrained(pipe_dir)
    prompt = "two red circles left of a blue square"
    cond = conditioning(pipe, [prompt])
    embeds, pooled = cond["encoder_hidden_states"], cond["pooled_projections"]
    torch.set_num_threads(1)
    engine = SGLangEngine(SGLangEngineConfig(model_path=str(pipe_dir)))
    try:
        (t,) = engine.generate([RolloutRequest(prompt=prompt, seed=3, num_steps=4, height=32, width=32,
                                               sde_type="ode", max_sequence_length=TEXT_LEN)])
    finally:
        engine.shutdown()
    assert torch.equal(t.conditioning["encoder_hidden_states"], embeds[0])
    # The pooled CLIP projections go through SGLang's own CLIP text projection: on some CPUs (seen on an AMD EPYC)
    # its GEMM kernel rounds differently from transformers' in the last bit (<= 1 ulp, 9.5e-7 at magnitude ~9).
    torch.testing.assert_close(t.conditioning["pooled_projections"], pooled[0], rtol=0, atol=2e-6)
    assert t.latents.shape == (5, 4, 16, 16)
    torch.testing.assert_close(t.image, decode(pipe.vae, t.latents[-1:])[0], atol=1e-5, rtol=0)


def test_eval_shapes_pipeline_cli(pretrained, tmp_path):
    cmd = [sys.executable, "-m", "megaflow.cli", "eval", "shapes", "--pipeline", str(pretrained[0] / "pipeline"),
           "--num", "10", "--num-seen", "4", "--steps", "4", "--out", str(tmp_path / "ev")]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["num"] == 10 and res["seen"]["num"] == 4 and len(res["ci95"]) == 2
    assert (tmp_path / "ev" / "grid.png").is_file() and (tmp_path / "ev" / "manifest.jsonl").is_file()


@pytest.mark.parametrize("config, algo_sets", [
    ("shapes_demo.toml", ["algo.nft_num_timesteps=3"]),
    ("shapes_demo_flowgrpo.toml", ["rollout.sde_window_size=2", "rollout.sde_window_range=[0,3]"])])
def test_demo_end_to_end_on_the_tiny_pretrained_pipeline(pretrained, tmp_path, config, algo_sets):
    """``megaflow demo`` (DiffusionNFT, and the FlowGRPO config): before/after evaluation on the same prompts and
    seeds around the run; summary.json, grids and curves.png are written and the last line is the before -> after
    line."""
    sets = [f"model.pretrained='{pretrained[0] / 'pipeline'}'", f"run.output_dir='{tmp_path}'", "run.name='d'",
            "train.iterations=2", "rollout.group_size=2", "rollout.prompts_per_iter=2", "rollout.num_steps=4",
            "eval.num=5", "eval.num_seen=2", "eval.num_train=3", "train.micro_batch_size=4", *algo_sets]
    cmd = [sys.executable, "-m", "megaflow.cli", "demo", "-c", f"configs/{config}"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("ShapeEval (held-out, 5 prompts): ")
    run_dir = tmp_path / "d"
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("shapeeval_before", "shapeeval_after", "ci95_before", "ci95_after", "per_category_before",
                "per_category_after", "wall_s", "peak_rss_gb", "iterations", "images_sampled"):
        assert key in summary, key
    assert summary["iterations"] == 2 and summary["images_sampled"] == 2 * 2 * 2 + 2 * (7 + 3)
    assert summary["algorithm"] == ("nft" if config == "shapes_demo.toml" else "flowgrpo")
    assert summary["num_train_prompts"] == 3 and 0 <= summary["train_prompts_after"] <= 1
    assert 0 < summary["peak_rss_gb"] < 12
    for when in ("before", "after"):
        assert (run_dir / f"eval_{when}" / "grid.png").is_file()
    assert (run_dir / "curves.png").is_file()
    before = [json.loads(x)["prompt"] for x in (run_dir / "eval_before" / "manifest.jsonl").read_text().splitlines()]
    after = [json.loads(x)["prompt"] for x in (run_dir / "eval_after" / "manifest.jsonl").read_text().splitlines()]
    assert before == after


def test_pretrain_continues_from_a_saved_pipeline(pretrained, tmp_path):
    """``pretrain.init_from``: the text encoders and VAE are taken as they are, the DiT continues training."""
    from safetensors.torch import load_file
    src = pretrained[0] / "pipeline"
    cmd = [sys.executable, "-m", "megaflow.cli", "pretrain", "-c", "configs/shapes_pretrain.toml"]
    for s in [f"pretrain.init_from='{src}'", f"run.output_dir='{tmp_path}'", "run.name='c'", "pretrain.num_images=128",
              "pretrain.max_steps=5", "pretrain.eval_every=5", "pretrain.eval_prompts=5", "pretrain.batch_size=8"]:
        cmd += ["--set", s]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "c" / "pipeline"
    meta = json.loads((out / "megaflow.json").read_text())
    assert meta["pretrain"]["parts"]["init_from"] == str(src) and meta["pretrain"]["parts"]["previous"]["step"] == 40
    for part in ("vae", "text_encoder"):
        (a,), (b,) = sorted((src / part).glob("*.safetensors")), sorted((out / part).glob("*.safetensors"))
        assert all(torch.equal(x, load_file(str(b))[k]) for k, x in load_file(str(a)).items()), part
    before = load_file(str(next((src / "transformer").glob("*.safetensors"))))
    after = load_file(str(next((out / "transformer").glob("*.safetensors"))))
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
