"""Rank functions for tests/export (module-level: pickled by reference into the rank). Each makes a
hand-made run's checkpoint: the run's Trainer (built from ``<run>/config.toml`` and ``pipeline_dir``)
with moved weights, saved as checkpoint ``iteration`` of ``run_dir``; each returns the weights the
engines would get (``engine_named_params``: diffusers names, full tensors)."""
from __future__ import annotations

import json
from pathlib import Path

import megaflow  # noqa: F401  (import guards before megatron)
import torch


def _trainer(run_dir: str, pipeline_dir: str):
    from megaflow.run.build import build_trainer
    from megaflow.config import load_config
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import init_distributed

    cfg = load_config(Path(run_dir) / "config.toml")
    init_distributed(ParallelDims(), seed=cfg.run.seed)
    trainer, _ = build_trainer(cfg, Path(pipeline_dir))
    return cfg, trainer


def _save(cfg, trainer, run_dir: str, pipeline_dir: str, iteration: int, *, optimizer) -> dict:
    from megaflow.bridge.convert import engine_named_params
    from megaflow.rundir.checkpoints import MODEL_DIR, STATE_FILE, checkpoint_dir
    from megaflow.parallel.distributed import destroy_distributed
    from megaflow.trainer.checkpoint import save_checkpoint
    from megaflow.trainer.manifest import write_manifest

    ckpt = checkpoint_dir(run_dir, iteration)
    dconfig = json.loads((Path(pipeline_dir) / "transformer" / "config.json").read_text())
    save_checkpoint(trainer.chunks, ckpt / MODEL_DIR, family=cfg.model.family, diffusers_config=dconfig,
                    optimizer=optimizer)
    (ckpt / STATE_FILE).write_text(json.dumps({"iteration": iteration}))
    write_manifest(ckpt)  # last, as megaflow.rundir.checkpoint_io.save does
    weights = {k: v.clone() for k, v in engine_named_params(trainer)}
    destroy_distributed()
    return weights


def train_and_checkpoint(run_dir: str, pipeline_dir: str, iteration: int, steps: int) -> dict:
    """SD3: ``steps`` rectified-flow Adam steps on seeded random data; saves model + optimizer."""
    from megaflow.trainer.runner import rectified_flow_microbatch

    cfg, trainer = _trainer(run_dir, pipeline_dir)
    dconfig = json.loads((Path(pipeline_dir) / "transformer" / "config.json").read_text())
    gen = torch.Generator().manual_seed(123)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    for _ in range(steps):
        latents = (2, dconfig["in_channels"], 8, 8)
        mb = rectified_flow_microbatch(randn(*latents), randn(*latents), torch.rand(2, generator=gen),
                                       randn(2, 6, dconfig["joint_attention_dim"]),
                                       randn(2, dconfig["pooled_projection_dim"]))
        trainer.train_step([mb])
    return _save(cfg, trainer, run_dir, pipeline_dir, iteration, optimizer=trainer.optimizer)


def perturb_and_checkpoint(run_dir: str, pipeline_dir: str, iteration: int, scale: float) -> dict:
    """Any family: every parameter moved by seeded Gaussian noise of ``scale``; saves the model only."""
    cfg, trainer = _trainer(run_dir, pipeline_dir)
    gen = torch.Generator().manual_seed(321)
    with torch.no_grad():
        for chunk in trainer.chunks:
            for p in chunk.parameters():
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return _save(cfg, trainer, run_dir, pipeline_dir, iteration, optimizer=None)
