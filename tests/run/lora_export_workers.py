"""Rank function of tests/run/test_lora_export.py (module-level: pickled into the rank)."""
from __future__ import annotations

import json
from pathlib import Path

import megaflow  # noqa: F401  (import guards before megatron)
import torch


def _microbatches(dconfig: dict, steps: int) -> list[dict]:
    from megaflow.trainer.runner import rectified_flow_microbatch
    gen = torch.Generator().manual_seed(123)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    latents = (2, dconfig["in_channels"], 8, 8)
    return [rectified_flow_microbatch(randn(*latents), randn(*latents), torch.rand(2, generator=gen),
                                      randn(2, 6, dconfig["joint_attention_dim"]), randn(2, dconfig["pooled_projection_dim"]))
            for _ in range(steps)]


def _velocity(trainer, mb) -> torch.Tensor:
    return trainer.velocity(mb["latents"], mb["sigma"], mb["encoder_hidden_states"], mb["pooled_projections"])


def lora_run_rank(run_dir: str, pipeline_dir: str, iteration: int, steps: int, probe_path: str) -> dict:
    """The run's LoRA trainer (``megaflow.run.build.build_trainer``: base from the pipeline, adapters from
    ``lora.init``): its velocity on the probe before training; ``steps`` Adam steps; its velocity after;
    checkpoint ``iteration`` through ``megaflow.rundir.checkpoint_io.save``; then a fresh trainer resumed with
    ``megaflow.rundir.checkpoint_io.load`` and one more step on both (losses and adapters must agree)."""
    from megaflow.config import load_config
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed
    from megaflow.run.build import build_trainer
    from megaflow.rundir.checkpoint_io import load as load_state, save as save_state

    cfg = load_config(Path(run_dir) / "config.toml")
    dconfig = json.loads((Path(pipeline_dir) / "transformer" / "config.json").read_text())
    probe = torch.load(probe_path)
    init_distributed(ParallelDims(), seed=cfg.run.seed)
    trainer, ref = build_trainer(cfg, Path(pipeline_dir))
    v_init = _velocity(trainer, probe)
    mbs = _microbatches(dconfig, steps + 1)
    losses = [float(trainer.train_step([mb])["loss"]) for mb in mbs[:steps]]
    v_trained = _velocity(trainer, probe)
    save_state(trainer, Path(run_dir), iteration, family=cfg.model.family, diffusers_config=dconfig,
               prompts_consumed=0, metrics_rows=[], keep=2)
    next_loss = float(trainer.train_step([mbs[steps]])["loss"])
    after = {k: v.clone() for k, v in trainer.iter_full_adapters()}

    resumed, _ = build_trainer(cfg, Path(pipeline_dir))
    from megaflow.rundir.checkpoints import checkpoint_dir
    load_state(resumed, checkpoint_dir(run_dir, iteration))
    v_resumed = _velocity(resumed, probe)
    resumed_loss = float(resumed.train_step([mbs[steps]])["loss"])
    resumed_after = dict(resumed.iter_full_adapters())
    destroy_distributed()
    return dict(v_init=v_init, v_trained=v_trained, v_resumed=v_resumed, losses=losses, next_loss=next_loss,
                resumed_loss=resumed_loss, reference=type(ref).__name__,
                adapter_err=max(float((after[k] - resumed_after[k]).abs().max()) for k in after))
