"""The embedded SGLang engine with the tiny Wan 2.1 T2V pipeline on CPU (needs: engine; one engine shared by the
module, ~2-3 min on 2 cores).

SGLang's native Wan pipeline (model id from the card) samples 5-frame clips: SDE / CPS (with an SDE window) / ODE
and CFG rollouts. Checks: the frame axis (trajectories [B, steps+1, C, F', H', W'], videos [F, 3, H, W]); per-step
log-probs recomputed with megaflow's flow math from the engine's velocities (1e-6) and by the megatron Wan trainer
in fp32 (1e-5; control: another prompt's text is off by > 10x that, CPS's small no-constant log-probs
included); the text conditioning equals diffusers'
WanPipeline.encode_prompt with SGLang's padding (512 tokens, zero rows past the prompt; 1e-5); a weight update by
diffusers names (through megaflow's Wan weight map and back) is verified by digest, changes the samples, and
restoring the weights brings the samples back bit-exactly, and a separate check request by diffusers names passes.
"""
from __future__ import annotations

import json

import pytest
import torch

import megaflow  # noqa: F401  (import guards before sglang/megatron)
from megaflow.families import card
from megaflow.flow.step import config_for_step, sigma_max_of, transition_log_prob
from megaflow.rollout.types import RolloutRequest
from megaflow.testing.dist import run_multiprocess
from megaflow.testing.reference import sde_step_indices, transition_config
import megaflow.rollout.sglang as sglang_engine

import wan_engine_workers as W

pytestmark = [pytest.mark.engine, pytest.mark.slow]

STEPS, FRAMES, HEIGHT, WIDTH = 3, 5, 32, 48
KINDS = {"sde": dict(sde_type="sde"),
         "cps": dict(sde_type="cps", noise_level=0.8, log_prob_no_const=True, sde_step_indices=[1, 2]),
         "ode": dict(sde_type="ode"),
         "cfg": dict(sde_type="sde", do_cfg=True, guidance_scale=4.0, negative_prompt="blurry")}


def _requests(kind: str, **kw):
    common = {**dict(num_steps=STEPS, num_frames=FRAMES, fps=8, height=HEIGHT, width=WIDTH, return_model_outputs=True),
              **KINDS[kind], **kw}
    return [RolloutRequest(prompt="a red cat", num_outputs=2, seed=5, **common),
            RolloutRequest(prompt="two blue squares", num_outputs=1, seed=9, **common)]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, tiny_pipeline_tool):
    return tiny_pipeline_tool.make_tiny_pipeline("wan", tmp_path_factory.mktemp("tiny-wan") / "p", seed=0)


@pytest.fixture(scope="module")
def engine(pipeline):
    torch.set_num_threads(1)
    eng = sglang_engine.SGLangEngine(sglang_engine.SGLangEngineConfig(model_path=str(pipeline), family="wan",
                                                                      engine_id="wan0", num_threads=1))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def rollouts(engine):
    return {kind: engine.generate(_requests(kind)) for kind in KINDS}


def test_card_selects_sglangs_native_wan_pipeline():
    from sglang.multimodal_gen.configs.pipeline_configs.wan import WanT2V480PConfig
    from sglang.multimodal_gen.registry import _get_config_info

    info = _get_config_info("any-local-dir", model_id=card("wan").sglang_model_id)
    assert info is not None and info.pipeline_config_cls is WanT2V480PConfig


def test_trajectories_have_a_frame_axis(rollouts):
    latent_frames = (FRAMES - 1) // 4 + 1
    for kind, trajs in rollouts.items():
        latents = torch.stack([t.latents for t in trajs])
        assert latents.shape == (3, STEPS + 1, 16, latent_frames, HEIGHT // 8, WIDTH // 8), kind
        assert torch.stack([t.model_outputs for t in trajs]).shape == (3, STEPS, *latents.shape[2:])
        for t in trajs:
            assert t.num_frames == FRAMES and t.fps == 8 and t.image.shape == (FRAMES, 3, HEIGHT, WIDTH)
            assert 0 <= t.image.min() and t.image.max() <= 1 and t.image.std() > 0
        assert not torch.equal(trajs[0].latents[-1], trajs[1].latents[-1])  # distinct seeds
    assert "negative_encoder_hidden_states" in rollouts["cfg"][0].conditioning


def test_log_probs_recompute_with_flow_math(rollouts):
    for kind, trajs in rollouts.items():
        for t in trajs:
            config, window = transition_config(t), sde_step_indices(t)
            recomputed = torch.stack([
                transition_log_prob(t.latents[i:i + 1], t.model_outputs[i:i + 1], t.latents[i + 1:i + 2],
                                    t.sigmas[i], t.sigmas[i + 1], sigma_max=sigma_max_of(t.sigmas),
                                    config=config_for_step(config, i, window)).log_prob[0]
                for i in range(t.num_steps)])
            torch.testing.assert_close(recomputed, t.log_probs, atol=1e-6, rtol=0, msg=kind)
            assert bool((t.log_probs[~t.sde_mask] == 0).all())
            if kind in ("sde", "cfg"):
                assert bool((t.log_probs != 0).all())
    assert not rollouts["ode"][0].sde_mask.any() and rollouts["cps"][0].sde_mask.tolist() == [False, True, True]


def test_text_conditioning_is_diffusers_with_sglangs_padding(rollouts, pipeline):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(pipeline, torch_dtype=torch.float32)
    t = rollouts["cfg"][2]  # "two blue squares", negative "blurry"
    states = t.conditioning["encoder_hidden_states"]
    length = card("wan").default_text_tokens
    assert states.shape == (length, 32)
    with torch.no_grad():
        positive, negative = pipe.encode_prompt(t.prompt, "blurry", do_classifier_free_guidance=True,
                                                max_sequence_length=length)
    torch.testing.assert_close(states, positive[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(t.conditioning["negative_encoder_hidden_states"], negative[0], atol=1e-5, rtol=0)
    tokens = int(pipe.tokenizer(t.prompt).attention_mask.count(1))
    assert states[:tokens].abs().sum(-1).min() > 0 and bool((states[tokens:] == 0).all())


def test_trainer_log_probs_match_engine(rollouts, pipeline, tmp_path):
    paths = {}
    for kind in ("sde", "cps", "cfg"):
        paths[kind] = str(tmp_path / f"{kind}.pt")
        torch.save(rollouts[kind], paths[kind])
    (report,) = run_multiprocess(W.trainer_log_prob_rank, 1, str(pipeline), paths, timeout_s=600)
    print(f"max |trainer - engine| log-prob: {report}")
    for kind in paths:
        assert report[kind] <= 1e-5, report
        assert report[f"{kind}/other_prompt"] > 10 * max(report[kind], 1e-6), report


def test_weight_update_by_diffusers_names_round_trips(engine, pipeline):
    from safetensors.torch import load_file

    from megaflow.checksum import tensor_digest
    from megaflow.models.wan import from_diffusers, weight_map

    dcfg = json.loads((pipeline / "transformer" / "config.json").read_text())
    state = load_file(pipeline / "transformer" / "diffusion_pytorch_model.safetensors")
    config = from_diffusers(dcfg)
    back = weight_map.to_diffusers(weight_map.to_megatron_full(state, config), config)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    request = _requests("ode", return_model_outputs=False, return_images=False)[:1]
    before = engine.generate(request)[0].latents
    g = torch.Generator().manual_seed(0)
    assert engine.update_weights({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in back.items()}.items()).ok
    changed = engine.generate(request)[0].latents
    assert engine.update_weights(back.items()).ok
    assert engine.verify_weights({n: tensor_digest(t, engine.config.checksum) for n, t in back.items()})[0]
    after = engine.generate(request)[0].latents
    assert (changed[-1] - before[-1]).abs().max() > 1e-3
    assert torch.equal(after, before)
