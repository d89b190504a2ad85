"""FLUX.1 parity with the real SGLang engine: trajectories sampled by the embedded engine from a tiny FLUX.1-dev
pipeline (packed latents, embedded guidance 3.5, SDE and CPS with an SDE window), replayed by the megatron
FLUX trainer from microbatches the family builds (txt_ids, img_ids, guidance). Tolerance: every stochastic
step's log-prob <= 1e-5 abs of the engine's, at TP=1 and at TP=2 with sequence parallelism; control: the
same batch replayed with guidance 1.0 is off by > 1e-4.

Needs: CPU; starts one SGLang engine on a tiny FLUX pipeline (~1 min), then gloo worlds of 1 and 2.
"""
from __future__ import annotations

import pytest
import torch

import megaflow  # noqa: F401  (import guards before sglang/megatron)
from megaflow.rollout.types import RolloutRequest
from megaflow.testing.dist import run_multiprocess
import megaflow.rollout.sglang as sglang_engine

import flux_grpo_workers as W

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.dist]
KINDS = {"sde": dict(sde_type="sde"),
         "cps": dict(sde_type="cps", noise_level=0.8, log_prob_no_const=True, sde_step_indices=[1, 2])}


def test_flux_trainer_log_probs_match_engine(tiny_pipeline_tool, tmp_path):
    torch.set_num_threads(1)
    pipeline = tiny_pipeline_tool.make_tiny_pipeline("flux", tmp_path / "tiny-flux", seed=0)
    engine = sglang_engine.SGLangEngine(sglang_engine.SGLangEngineConfig(model_path=str(pipeline), family="flux"))
    paths = {}
    try:
        for name, kw in KINDS.items():
            trajs = engine.generate([
                RolloutRequest(prompt="a red circle", num_outputs=3, seed=5, num_steps=4, guidance_scale=3.5,
                               height=32, width=48, max_sequence_length=32, return_images=False, **kw),
                RolloutRequest(prompt="two blue squares", num_outputs=2, seed=9, num_steps=4, guidance_scale=3.5,
                               height=32, width=48, max_sequence_length=32, return_images=False, **kw)])
            assert trajs[0].latents.shape == (5, 6, 64) and trajs[0].conditioning["encoder_hidden_states"].shape[0] == 32
            paths[name] = str(tmp_path / f"{name}.pt")
            torch.save(trajs, paths[name])
    finally:
        engine.shutdown()
    (tp1,) = run_multiprocess(W.engine_log_prob_rank, 1, str(pipeline), paths, 1, False, timeout_s=600)
    tp2 = run_multiprocess(W.engine_log_prob_rank, 2, str(pipeline), paths, 2, True, timeout_s=600)
    print(f"max |trainer - engine| log-prob: TP=1 {tp1}, TP=2+SP {tp2}")
    for r in (tp1, *tp2):
        for name in KINDS:
            assert r[name] <= 1e-5, r
            assert r[f"{name}/guidance_1"] > 1e-4, r
