"""Rank function for tests/bridge/test_bf16.py: a bf16 megatron trainer (fp32 main params in the optimizer)
syncing into a bf16 SGLang engine with verification, built through megaflow.run.build from a config.

Module-level functions only: pickled by reference into the rank.
"""
from __future__ import annotations

import megaflow  # noqa: F401  (import guards before megatron)

from megaflow.parallel.dims import ParallelDims
from megaflow.parallel.distributed import destroy_distributed, init_distributed


def bf16_sync_rank(pipeline_dir: str) -> dict:
    """Trainer + engine from config (model.dtype bfloat16, rollout.precision bf16, bridge.verify true):
    verified sync of the loaded weights, one SFT train step, a second verified sync, an engine rollout; the
    dtypes of the trainer's params, optimizer main params and the engine's DiT tensors."""
    from pathlib import Path

    from megaflow.run.build import build_bridge, build_engines, build_trainer
    from megaflow.bridge.convert import engine_named_params
    from megaflow.config import load_config
    from megaflow.config.preflight import preflight
    from megaflow.models.sd3 import tiny
    from megaflow.trainer.runner import rectified_flow_microbatch

    cfg = preflight(load_config(None, ["model.dtype=bfloat16", "rollout.precision=bf16", "bridge.verify=true",
                                       "algo.kl_beta=0.04"]), "show")
    init_distributed(ParallelDims(), seed=0)
    trainer, ref = build_trainer(cfg, Path(pipeline_dir))
    engines = build_engines(cfg, Path(pipeline_dir))
    out = {}
    try:
        bridge = build_bridge(cfg, engines, Path(pipeline_dir).parent, Path(pipeline_dir))
        first = bridge.push(engine_named_params(trainer))
        dcfg = {k: v for k, v in trainer.family.config_to_diffusers(trainer.config).items() if not k.startswith("_")}
        b = tiny.sft_batches(dcfg, num_microbatches=1, batch=2, context_len=8, latent_size=8)[0]
        mb = rectified_flow_microbatch(b["x0"], b["noise"], b["sigma"], b["encoder_hidden_states"],
                                       b["pooled_projections"])
        before = {k: v.clone() for k, v in trainer.iter_full_params()}
        step = trainer.train_step([mb])
        moved = max(float((v.float() - before[k].float()).abs().max()) for k, v in trainer.iter_full_params())
        second = bridge.push(engine_named_params(trainer))
        main = [p for g in trainer.optimizer.optimizer.param_groups for p in g["params"]]
        out = dict(
            first_verified=first.verified, second_verified=second.verified, num_tensors=second.num_tensors,
            loss=float(step["loss"]), update_ok=bool(step["update_ok"]), moved=moved,
            param_dtypes=sorted({str(p.dtype) for c in trainer.chunks for p in c.parameters()}),
            main_dtypes=sorted({str(p.dtype) for p in main}),
            ref_dtypes=sorted({str(p.dtype) for c in ref.chunks for p in c.parameters()}),
            sent_dtypes=sorted({str(t.dtype) for _, t in engine_named_params(trainer)}))
    finally:
        for e in engines:
            e.shutdown()
        destroy_distributed()
    return out
