"""The plain diffusers baseline loop (``megaflow.rollout.baseline``). Needs: CPU, 1 process, no sglang.

Runs on a tiny SD3 pipeline built in memory by ``tools/make_tiny_pipeline.py``; its ODE path is checked
against diffusers' own ``StableDiffusion3Pipeline.__call__`` and its log-probs against
``megaflow.flow.step.transition_log_prob`` recomputed from the stored trajectory.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import megaflow  # noqa: F401
from megaflow.flow.schedule import sd3_sigmas
from megaflow.flow.step import TransitionConfig, sigma_max_of, transition_log_prob
from megaflow.rollout.baseline import DiffusersEngine, DiffusersEngineConfig
from megaflow.rollout.engine import RolloutEngine
from megaflow.rollout.types import RolloutRequest

REPO = Path(__file__).resolve().parents[2]
SEQ = 16  # T5 tokens: short keeps the tiny DiT fast


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    from megaflow.models.tiny_pipeline import build_sd3
    pipe = build_sd3(seed=0)
    pipe.set_progress_bar_config(disable=True)
    return DiffusersEngine(pipe, config=DiffusersEngineConfig(engine_id="base", max_sequence_length=SEQ))


def _req(**kw) -> RolloutRequest:
    base = dict(prompt="a red circle", num_outputs=2, seed=7, num_steps=3, height=32, width=32)
    return RolloutRequest(**{**base, **kw})


def test_trajectory_fields_and_recomputed_log_probs(engine):
    assert isinstance(engine, RolloutEngine)
    assert engine.generate([_req()])[0].model_outputs is None  # velocities only on request
    trajs = engine.generate([_req(sde_step_indices=[0, 1], return_model_outputs=True)])
    assert [t.index for t in trajs] == [0, 1] and [t.seed for t in trajs] == [7, 8]
    t = trajs[0]
    assert t.latents.shape == (4, 16, 4, 4) and t.model_outputs.shape == (3, 16, 4, 4)
    torch.testing.assert_close(t.sigmas, sd3_sigmas(3, shift=3.0), rtol=0, atol=0)
    assert t.image.shape == (3, 32, 32) and 0 <= float(t.image.min()) <= float(t.image.max()) <= 1
    assert t.conditioning["encoder_hidden_states"].shape == (77 + SEQ, 64)
    assert t.conditioning["pooled_projections"].shape == (64,)
    assert t.sde_mask.tolist() == [True, True, False] and float(t.log_probs[2]) == 0.0
    # the stored log-probs are what the trainer recomputes from (x_t, v_t, x_{t+1})
    cfg = TransitionConfig(kind="sde", noise_level=0.7)
    for i in range(2):
        ref = transition_log_prob(t.latents[i:i + 1], t.model_outputs[i:i + 1], t.latents[i + 1:i + 2],
                                  t.sigmas[i], t.sigmas[i + 1], sigma_max=sigma_max_of(t.sigmas), config=cfg)
        torch.testing.assert_close(t.log_probs[i:i + 1], ref.log_prob, rtol=1e-4, atol=1e-4)


def test_ode_path_equals_diffusers_pipeline(engine):
    trajs = engine.generate([_req(sde_type="ode", prompt="a blue square")])
    noise = torch.stack([t.latents[0] for t in trajs])
    ref = engine.pipe(prompt=["a blue square"] * 2, num_inference_steps=3, height=32, width=32, guidance_scale=1.0,
                      latents=noise.clone(), output_type="latent", max_sequence_length=SEQ).images
    torch.testing.assert_close(torch.stack([t.latents[-1] for t in trajs]), ref, rtol=1e-4, atol=1e-4)
    assert all(float(t.log_probs.abs().sum()) == 0.0 for t in trajs)


def test_samples_do_not_depend_on_batching(engine):
    a, b = _req(prompt="a red circle", seed=1), _req(prompt="a green star", seed=50, num_outputs=3)
    other = _req(num_steps=2, seed=9, num_outputs=1)  # incompatible: runs in its own loop, order kept
    together = engine.generate([a, other, b])
    assert [(t.request_id, t.index) for t in together] == (
        [(a.request_id, 0), (a.request_id, 1), (other.request_id, 0)] + [(b.request_id, j) for j in range(3)])
    alone = engine.generate([b])
    chunked = DiffusersEngine(engine.pipe, config=DiffusersEngineConfig(max_batch_size=2, max_sequence_length=SEQ))
    for ref_set in (alone, chunked.generate([b])):
        for got, ref in zip(together[3:], ref_set):
            torch.testing.assert_close(got.latents, ref.latents, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(got.log_probs, ref.log_probs, rtol=1e-4, atol=1e-5)
    assert not torch.equal(together[0].latents[0], together[1].latents[0]), "seeds must differ per output"


def test_cfg_and_cps(engine):
    trajs = engine.generate([_req(do_cfg=True, guidance_scale=4.0, sde_type="cps", noise_level=0.8,
                                  log_prob_no_const=True, return_images=False)])
    t = trajs[0]
    assert t.image is None and "negative_encoder_hidden_states" in t.conditioning
    assert torch.isfinite(t.log_probs).all() and t.do_cfg and t.guidance_scale == 4.0


def test_weight_update_all_or_nothing(engine):
    name = "transformer_blocks.0.attn.to_q.weight"
    old = engine.transformer.state_dict()[name].clone()
    before = engine.checksum()
    bad = engine.update_weights([(name, old + 1), ("missing.weight", old)])
    assert not bad.ok and "missing.weight" in bad.message and engine.checksum() == before
    good = engine.update_weights([(name, old + 1)])
    assert good.ok and good.num_bytes == old.numel() * 4 and engine.checksum() != before
    engine.update_weights([(name, old)])
    assert engine.checksum() == before
