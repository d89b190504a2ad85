"""CFG parity with the real SGLang engine: trajectories sampled by the embedded engine with guidance 4.5
(two DiT branches per step, sglang's ``CFGPolicy.combine``), replayed by the megatron trainer from the
trajectory (negative + positive conditioning, guided velocity). Tolerance: every step's log-prob
<= 1e-5 abs of the engine's; recomputing with the conditional branch alone is off by > 1e-4 (control).

Needs: CPU; starts one SGLang engine on the session's tiny SD3 pipeline (~1 min), then a gloo world of 1.
"""
from __future__ import annotations

import pytest
import torch

import megaflow  # noqa: F401  (import guards before sglang/megatron)
from megaflow.rollout.types import RolloutRequest
from megaflow.testing.dist import run_multiprocess
import megaflow.rollout.sglang as sglang_engine

import grpo_workers as W

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.dist]


def test_trainer_log_probs_match_engine_under_cfg(tiny_sd3_dir, tmp_path):
    torch.set_num_threads(1)
    engine = sglang_engine.SGLangEngine(sglang_engine.SGLangEngineConfig(model_path=str(tiny_sd3_dir)))
    try:
        trajs = engine.generate([
            RolloutRequest(prompt="a red circle", num_outputs=3, seed=5, num_steps=4, do_cfg=True,
                           guidance_scale=4.5, return_images=False),
            RolloutRequest(prompt="two blue squares", num_outputs=2, seed=9, num_steps=4, do_cfg=True,
                           guidance_scale=4.5, negative_prompt="green", return_images=False)])
    finally:
        engine.shutdown()
    assert all(t.do_cfg and "negative_encoder_hidden_states" in t.conditioning for t in trajs)
    torch.save(trajs, tmp_path / "trajs.pt")
    (r,) = run_multiprocess(W.engine_log_prob_rank, 1, str(tiny_sd3_dir), str(tmp_path / "trajs.pt"), timeout_s=600)
    print(f"max |trainer - engine| log-prob: {r}")
    assert r["cfg"] <= 1e-5, r
    assert r["no_cfg"] > 1e-4, r
