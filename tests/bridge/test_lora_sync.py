"""The LoRA sync path (megaflow.bridge.lora) into a real SGLang engine: only adapters move, the engine verifies
them by SHA-256, and its effective weights are base + alpha / rank * B @ A: the velocities the engine used
while sampling equal the LoRA trainer's at the same states (<= 1e-5, fp32), for a first adapter and for a
second one that must REPLACE it (not add to it). An engine that skipped a layer, merged with the wrong scale
or kept the first adapter's merge differs; the test checks that the stale engine (before each push) does
differ by > 1e-3 (adapters 0.1 * N(0, 1)).

Needs: engine (one SGLang engine on the tiny SD3 pipeline, ~1 min), CPU, 1 process.
"""
from __future__ import annotations

import pytest
import torch

import megaflow  # noqa: F401  (import guards before sglang/megatron)
from megaflow.rollout.types import RolloutRequest
import megaflow.rollout.sglang as sglang_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]
RANK, ALPHA = 4, 8.0


def _trainer(pipeline):
    import json

    from megaflow.models.common.lora import LoRASettings
    from megaflow.models.sd3 import from_diffusers
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import init_distributed
    from megaflow.trainer.checkpoint import read_diffusers_weights
    from megaflow.trainer.runner import Trainer

    init_distributed(ParallelDims(), seed=0)
    dconfig = json.loads((pipeline / "transformer" / "config.json").read_text())
    trainer = Trainer(from_diffusers(dconfig), spec="local", lora=LoRASettings(rank=RANK, alpha=ALPHA))
    trainer.load_diffusers_state_dict(read_diffusers_weights(pipeline / "transformer"))
    return trainer


def _engine_vs_trainer(engine, trainer) -> float:
    """Largest |engine velocity - trainer velocity| over every step of one sampled trajectory."""
    [t] = engine.generate([RolloutRequest(prompt="a red cat", num_outputs=1, seed=5, num_steps=3,
                                          return_model_outputs=True)])
    steps = t.model_outputs.shape[0]
    cond = {k: t.conditioning[k].unsqueeze(0).expand(steps, *t.conditioning[k].shape)
            for k in ("encoder_hidden_states", "pooled_projections")}
    v = trainer.velocity(t.latents[:steps], t.sigmas[:steps], cond["encoder_hidden_states"], cond["pooled_projections"])
    return float((v - t.model_outputs).abs().max())


def test_lora_sync_merges_and_replaces_adapters(tiny_sd3_dir):
    from megaflow.bridge.lora import LoRABridge, sync_stream
    from megaflow.parallel.distributed import destroy_distributed

    torch.set_num_threads(1)
    trainer = _trainer(tiny_sd3_dir)
    engine = sglang_engine.SGLangEngine(sglang_engine.SGLangEngineConfig(model_path=str(tiny_sd3_dir)))
    try:
        assert _engine_vs_trainer(engine, trainer) <= 1e-5  # fresh adapters (B = 0): the base on both sides
        bridge = LoRABridge([engine], alpha=ALPHA, rank=RANK)
        shapes = {n: t.shape for n, t in trainer.iter_full_adapters()}
        full_bytes = sum(t.numel() * t.element_size() for _, t in trainer.iter_full_params())
        for seed in (1, 2):
            g = torch.Generator().manual_seed(seed)
            trainer.load_adapters({n: 0.1 * torch.randn(s, generator=g) for n, s in shapes.items()})
            assert _engine_vs_trainer(engine, trainer) > 1e-3, seed  # the engine still has the previous weights
            report = bridge.push(sync_stream(trainer))
            assert report.verified and report.num_tensors == len(shapes)
            assert report.num_bytes < full_bytes
            assert _engine_vs_trainer(engine, trainer) <= 1e-5, seed
    finally:
        engine.shutdown()
        destroy_distributed()
