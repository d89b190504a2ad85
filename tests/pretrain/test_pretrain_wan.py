"""``megaflow pretrain`` for Wan on video ShapeEval: the kit's tokenizer maps every grammar word to one UMT5 piece at
the position it says, a video prompt's labels carry its clause, the VAE keeps Wan's temporal compression (5 frames
-> 2 latent frames) at spatial factor 4; end to end on tiny settings, the saved pipeline loads in diffusers'
WanPipeline and a real SGLang engine conditions (the kit's ``encode_prompt`` at TEXT_LEN, 1e-6), steps (the kit's
sigma grid, 1e-6; Euler ODE steps of its own velocities, 1e-6; its first velocity equals diffusers' transformer on
the same input, 1e-4) and decodes (the kit's fp32 decode of its final latents, 1e-2: SGLang decodes Wan in bf16)
as the pretraining does. Needs: CPU, 1 process + engine workers (~3 min idle, 10 min on a loaded machine)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from megaflow.data.shapes import shapes_vocabulary
from megaflow.data.video_shapes import parse_video_prompt
from megaflow.models.wan import shapes as kit
from megaflow.pretrain.bench import bench_of
from megaflow.pretrain.text import CLAUSE_CLASSES, noun_positions, scene_labels

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = "a red circle left of a blue square, both moving up"


def test_every_word_is_one_piece_at_its_position():
    tok, _ = kit.text_components(seed=0)
    ids = tok(PROMPT)["input_ids"]
    pieces = tok.convert_ids_to_tokens(ids)
    assert [pieces[i] for i in kit.word_positions(tok, PROMPT)] == ["\u2581" + w.rstrip(",") for w in PROMPT.split()]
    assert pieces[kit.word_positions(tok, PROMPT)[7] + 1] == ","
    for w in (*shapes_vocabulary(), *kit.VIDEO_WORDS):
        assert len(kit.word_positions(tok, f"a {w}")) == 2, w
    with pytest.raises(ValueError, match="one token"):
        kit.word_positions(tok, "a reddish circle moving up")
    assert noun_positions(kit, tok, PROMPT) == [2, 7]


def test_video_labels_carry_the_clause():
    moving = scene_labels(parse_video_prompt(PROMPT))
    turning = scene_labels(parse_video_prompt("a red square turning blue"))
    assert CLAUSE_CLASSES[moving["pooled"][-1]] == "moving up"
    assert CLAUSE_CLASSES[turning["pooled"][-1]] == "turning blue"
    assert len(moving["nouns"]) == 2 and len(moving["pooled"]) == 8


def test_vae_keeps_wans_temporal_compression():
    bench = bench_of(kit)
    pixels = bench.render(["a red circle moving left", "a red square turning blue"], resolution=32, seed=0)
    assert pixels.shape == (2, 3, kit.FRAMES, 32, 32) and pixels.min() >= -1 and pixels.max() <= 1
    vae = kit.make_vae(seed=0)
    z = kit.encode(vae, pixels)
    assert z.shape == kit.latent_shape(2, 32) == (2, 16, 2, 8, 8)
    assert kit.decode(vae, z).shape == (2, kit.FRAMES, 3, 32, 32)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    out = tmp_path_factory.mktemp("pre")
    sets = ["run.name='p'", f"run.output_dir='{out}'", "pretrain.text_steps=5", "pretrain.vae_steps=3",
            "pretrain.num_images=64", "pretrain.max_steps=4", "pretrain.eval_every=4", "pretrain.eval_prompts=4",
            "pretrain.num_layers=1", "pretrain.num_heads=2", "pretrain.head_dim=16", "pretrain.batch_size=8"]
    cmd = [sys.executable, "-m", "megaflow.cli", "pretrain", "-c", "configs/shapes_pretrain_wan.toml", "--json"]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "p"


@pytest.mark.slow
@pytest.mark.engine
def test_pretrained_wan_loads_and_the_engine_samples_as_pretraining_evaluates(pretrained):
    from diffusers import WanPipeline

    from megaflow.rollout.sglang import SGLangEngine, SGLangEngineConfig
    from megaflow.rollout.types import RolloutRequest

    pipe_dir = pretrained / "pipeline"
    rows = [json.loads(line) for line in (pretrained / "pretrain.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4] and 0 <= rows[0]["clause_mean"] <= 1
    assert set(rows[0]["per_category"]) <= {"motion", "count_motion", "position_motion", "color_change"}
    meta = json.loads((pipe_dir / "megaflow.json").read_text())
    assert meta["pretrain"]["step"] == 4 and meta["max_sequence_length"] == kit.TEXT_LEN
    pipe = WanPipeline.from_pretrained(pipe_dir, torch_dtype=torch.float32)
    assert (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal) == (kit.SPATIAL_FACTOR, 4)
    cond = kit.conditioning(pipe, [PROMPT])["encoder_hidden_states"]
    torch.set_num_threads(1)
    engine = SGLangEngine(SGLangEngineConfig(model_path=str(pipe_dir), family="wan"))
    try:
        (t,) = engine.generate([RolloutRequest(prompt=PROMPT, seed=3, num_steps=4, height=32, width=32, num_frames=5,
                                               fps=8, sde_type="ode", max_sequence_length=kit.TEXT_LEN,
                                               return_model_outputs=True)])
    finally:
        engine.shutdown()
    torch.testing.assert_close(t.conditioning["encoder_hidden_states"], cond[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(t.sigmas.float(), kit.sample_sigmas(pipe, 4, 32), atol=1e-6, rtol=0)
    assert t.latents.shape == (5, *kit.latent_shape(1, 32)[1:])
    for i in range(4):
        step = t.latents[i] + (t.sigmas[i + 1] - t.sigmas[i]) * t.model_outputs[i]
        torch.testing.assert_close(t.latents[i + 1], step, atol=1e-6, rtol=0)
    with torch.no_grad():
        v = pipe.transformer(hidden_states=t.latents[:1].float(), timestep=t.sigmas[:1].float() * 1000,
                             encoder_hidden_states=cond).sample
    torch.testing.assert_close(t.model_outputs[0].float(), v[0], atol=1e-4, rtol=0)
    # SGLang's Wan pipeline decodes in bf16 (WanT2V480PConfig.vae_decode_precision), the kit in fp32: 1e-2 (bf16's
    # step near 1 is 2^-8 = 3.9e-3; 6.2e-3 seen). The 3-step VAE's decoder is nearly constant (the starting noise
    # decodes within 7.8e-3 too), so this checks the clip layout and range more than the decoder's numbers.
    assert t.image.shape == (kit.FRAMES, 3, 32, 32)
    torch.testing.assert_close(t.image, kit.decode(pipe.vae, t.latents[-1:].float())[0], atol=1e-2, rtol=0)
