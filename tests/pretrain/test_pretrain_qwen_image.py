"""``megaflow pretrain`` for Qwen-Image end to end on tiny settings, then the saved pipeline through diffusers and a
real SGLang engine: diffusers' QwenImagePipeline loads it, the engine's conditioning equals the kit's (the pipeline's
own prompt encoding, 1e-6), its sigma grid equals the one the pretraining evaluation samples with (1e-6), its
latents are 64 packed tokens of 16 channels (spatial factor 2, 2x2 packing) and its decoded image equals the kit's
decode of its final latents (1e-5). The kit's word positions point at the prompt's words inside the template.
Needs: CPU, 1 process + engine workers (~2 min)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from megaflow.data.shapes import shapes_vocabulary
from megaflow.models.qwen_image import shapes as kit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "two red circles left of a blue square"


def test_every_word_is_one_token_at_its_position_in_the_template():
    tok, _ = kit.text_components(seed=0)
    ids = tok(kit._TEMPLATE.format(PROMPT))["input_ids"]
    words = [tok.convert_tokens_to_string([tok.convert_ids_to_tokens(ids[i])]).strip()
             for i in kit.word_positions(tok, PROMPT)]
    assert words == PROMPT.split()
    for w in shapes_vocabulary():
        assert len(kit.word_positions(tok, f"a {w}")) == 2, w
    with pytest.raises(ValueError, match="one token"):
        kit.word_positions(tok, "a reddish circle")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    out = tmp_path_factory.mktemp("pre")
    sets = ["run.name='p'", f"run.output_dir='{out}'", "pretrain.text_steps=5", "pretrain.vae_steps=5",
            "pretrain.num_images=128", "pretrain.max_steps=4", "pretrain.eval_every=4", "pretrain.eval_prompts=4",
            "pretrain.num_layers=1", "pretrain.num_heads=2", "pretrain.head_dim=16", "pretrain.batch_size=8"]
    cmd = [sys.executable, "-m", "megaflow.cli", "pretrain", "-c", "configs/shapes_pretrain_qwen_image.toml", "--json"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "p"


@pytest.mark.slow
@pytest.mark.engine
def test_pretrained_qwen_image_loads_and_the_engine_samples_as_pretraining_evaluates(pretrained):
    from diffusers import QwenImagePipeline

    from megaflow.rollout.sglang import SGLangEngine, SGLangEngineConfig
    from megaflow.rollout.types import RolloutRequest

    pipe_dir = pretrained / "pipeline"
    rows = [json.loads(line) for line in (pretrained / "pretrain.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4]
    assert json.loads((pipe_dir / "megaflow.json").read_text())["pretrain"]["step"] == 4
    pipe = QwenImagePipeline.from_pretrained(pipe_dir)
    assert pipe.vae_scale_factor == kit.SPATIAL_FACTOR
    cond = kit.conditioning(pipe, [PROMPT])
    torch.set_num_threads(1)
    engine = SGLangEngine(SGLangEngineConfig(model_path=str(pipe_dir), family="qwen_image"))
    try:
        (t,) = engine.generate([RolloutRequest(prompt=PROMPT, seed=3, num_steps=4, height=32, width=32,
                                               sde_type="ode")])
    finally:
        engine.shutdown()
    n = int(cond["encoder_hidden_states_mask"][0].sum())
    torch.testing.assert_close(t.conditioning["encoder_hidden_states"][:n], cond["encoder_hidden_states"][0, :n],
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(t.sigmas.float(), kit.sample_sigmas(pipe, 4, 32), atol=1e-6, rtol=0)
    assert t.latents.shape[-2:] == (64, 16)
    torch.testing.assert_close(t.image, kit.decode(pipe.vae, t.latents[-1:].float())[0], atol=1e-5, rtol=0)


@pytest.mark.slow
def test_ship_writes_the_recipe_of_the_family_it_finds(pretrained, tmp_path):
    """tools/ship_pretrained.py names the pipeline's family from its transformer, describes it with that family's kit
    and lists a checksum for every shipped file."""
    import hashlib

    ev = {"num": 4, "seed": 0, "num_steps": 2, "accuracy": 0.25, "ci95": [0.0, 0.7], "partial_mean": 0.5,
          "per_category": {"colors": 0.25}, "per_category_num": {"colors": 4}}
    (tmp_path / "ev.json").write_text(json.dumps(ev))
    out = tmp_path / "shapeeval-qwen-image"
    proc = subprocess.run([sys.executable, "tools/ship_pretrained.py", "--pipeline", str(pretrained / "pipeline"),
                           "--out", str(out), "--eval", str(tmp_path / "ev.json"), "--commands", "megaflow pretrain x"],
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    recipe = (out / "RECIPE.md").read_text()
    assert recipe.startswith("# shapeeval-qwen-image: the pretrained ShapeEval model")
    assert "QwenImagePipeline" in recipe and "(1 blocks)" in recipe and "    megaflow pretrain x" in recipe
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "RECIPE.md")
    for p in files:
        assert f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(out)}" in recipe


@pytest.mark.slow
def test_the_diffusers_sampler_refuses_a_qwen_image_pipeline_in_one_line(pretrained):
    from megaflow.rollout.pipeline_sampler import PipelineSampler
    with pytest.raises(ValueError, match="is a QwenImagePipeline; the diffusers sampler runs StableDiffusion3Pipeline"):
        PipelineSampler.from_pretrained(str(pretrained / "pipeline"))
