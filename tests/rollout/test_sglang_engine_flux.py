"""The embedded SGLang engine with a tiny FLUX.1 pipeline on CPU (needs: engine; ~1 min).

FLUX.1-dev runs SGLang's native pipeline (packed latents, embedded guidance): trajectories come back
with rollout data and their log-probs recompute with megaflow's flow math.
"""
from __future__ import annotations

import pytest
import torch

import megaflow  # noqa: F401  (import guards before sglang/megatron)
from megaflow.flow.step import config_for_step, sigma_max_of, transition_log_prob
from megaflow.testing.reference import sde_step_indices, transition_config
from megaflow.rollout.types import RolloutRequest
import megaflow.rollout.sglang as sglang_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def test_flux_rollout_log_probs_recompute(tiny_pipeline_tool, tmp_path):
    torch.set_num_threads(1)
    path = tiny_pipeline_tool.make_tiny_pipeline("flux", tmp_path / "tiny-flux", seed=0)
    config = sglang_engine.SGLangEngineConfig(model_path=str(path), family="flux", engine_id="flux0")
    with sglang_engine.SGLangEngine(config) as engine:
        requests = [RolloutRequest(prompt=p, num_outputs=2, seed=i, num_steps=4, guidance_scale=3.5,
                                   sde_step_indices=[0, 1, 2], return_model_outputs=True) for i, p in enumerate(["a red cat", "a blue dog"])]
        trajs = engine.generate(requests)
        with pytest.raises(ValueError, match="FLUX"):
            engine.generate([RolloutRequest(prompt="x", do_cfg=True, guidance_scale=2.0)])
    assert len(trajs) == 4 and trajs[0].latents.shape[0] == 5 and trajs[0].image.shape == (3, 64, 64)
    assert "guidance" in trajs[0].conditioning
    for t in trajs:
        config, window = transition_config(t), sde_step_indices(t)
        recomputed = torch.stack([
            transition_log_prob(t.latents[i:i + 1], t.model_outputs[i:i + 1], t.latents[i + 1:i + 2], t.sigmas[i],
                                t.sigmas[i + 1], sigma_max=sigma_max_of(t.sigmas),
                                config=config_for_step(config, i, window)).log_prob[0]
            for i in range(t.num_steps)])
        torch.testing.assert_close(recomputed, t.log_probs, atol=1e-6, rtol=0)
        assert t.log_probs[3] == 0  # outside the SDE window
