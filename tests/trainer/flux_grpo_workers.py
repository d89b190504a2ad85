"""Rank functions for tests/trainer/test_grpo_flux_engine.py: the megatron FLUX trainer replays SGLang
FLUX trajectories (microbatches from the family's ``batch_conditioning``) and reports how far its
per-step log-probs are from the engine's."""
from __future__ import annotations

import dataclasses

import megaflow  # noqa: F401  (import guards before megatron)
import torch


def _trainer(pipeline_dir: str, tp: int, sp: bool):
    """The run's trainer (megaflow.run.build.build_trainer, model.family = "flux") at TP=``tp`` (SP ``sp``)."""
    from pathlib import Path

    from megaflow.run.build import build_trainer
    from megaflow.config import load_config

    cfg = load_config(None, ['model.family="flux"', f"parallel.tp={tp}", f"parallel.sp={str(sp).lower()}"])
    eng, _ = build_trainer(cfg, Path(pipeline_dir))
    return eng


def _max_log_prob_diff(eng, trajs, micro_batch_size: int) -> float:
    """max over every (sample, step) of |trainer log-prob - engine log-prob| (last pipeline stage)."""
    from megaflow.testing.reference import transition_config
    from megaflow.trainer.batch import batch_conditioning
    from megaflow.trainer.flowgrpo import _policy
    from megaflow.trainer.flowgrpo_batches import microbatches_for

    transition = transition_config(trajs[0])
    window = [t for t in range(trajs[0].num_steps) if bool(trajs[0].sde_mask[t])]
    items = [(i, t) for i in range(len(trajs)) for t in window]
    mbs = microbatches_for(trajs, torch.zeros(len(trajs)), items, micro_batch_size, torch.device("cpu"),
                           conditioning=batch_conditioning(eng))
    diffs = [(_policy(v, mb, transition).log_prob - mb["rollout_log_prob"]).abs()[mb["real"]]
             for mb, v in zip(mbs, eng.forward_backward(mbs, None, forward_only=True))]
    return float(torch.cat(diffs).max())


def engine_log_prob_rank(pipeline_dir: str, trajs_paths: dict[str, str], tp: int, sp: bool) -> dict:
    """{name: max |trainer - engine| log-prob} for each saved trajectory batch at TP=``tp`` (SP ``sp``),
    plus the control ``<name>/guidance_1`` (the same batch replayed with guidance_scale 1.0 instead of
    the sampled embedded guidance)."""
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed

    init_distributed(ParallelDims(tp=tp, sp=sp), seed=0)
    eng = _trainer(pipeline_dir, tp, sp)
    out = {}
    for name, path in trajs_paths.items():
        trajs = torch.load(path, weights_only=False)
        out[name] = _max_log_prob_diff(eng, trajs, micro_batch_size=3)
        wrong = [dataclasses.replace(t, guidance_scale=1.0) for t in trajs]
        out[f"{name}/guidance_1"] = _max_log_prob_diff(eng, wrong, micro_batch_size=3)
    destroy_distributed()
    return out
