"""Rank function for tests/export (module-level: pickled by reference into the rank)."""
from __future__ import annotations

import megaflow  # noqa: F401  (import guards before megatron)
import torch


def train_and_checkpoint(run_dir: str, pipeline_dir: str, iteration: int, steps: int) -> dict:
    """A hand-made run's checkpoint: build the run's TrainEngine from ``pipeline_dir``, take ``steps``
    rectified-flow Adam steps on seeded random data, save model + optimizer as checkpoint ``iteration``
    of ``run_dir`` and return the weights the engines would get (``runtime.engine_named_params``:
    diffusers names, full tensors)."""
    import json
    from pathlib import Path

    from megaflow import runtime
    from megaflow.checkpoints import MODEL_DIR, STATE_FILE, checkpoint_dir
    from megaflow.config import load_config
    from megaflow.parallel import ParallelDims, destroy_distributed, init_distributed
    from megaflow.trainer.checkpoint import save_checkpoint
    from megaflow.trainer.engine import rectified_flow_microbatch

    cfg = load_config(Path(run_dir) / "config.toml")
    init_distributed(ParallelDims(), seed=cfg.run.seed)
    trainer, _ = runtime.build_trainer(cfg, Path(pipeline_dir))
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
    ckpt = checkpoint_dir(run_dir, iteration)
    save_checkpoint(trainer.chunks, ckpt / MODEL_DIR, family=cfg.model.family, diffusers_config=dconfig,
                    optimizer=trainer.optimizer)
    (ckpt / STATE_FILE).write_text(json.dumps({"iteration": iteration}))
    weights = {k: v.clone() for k, v in runtime.engine_named_params(trainer)}
    destroy_distributed()
    return weights
