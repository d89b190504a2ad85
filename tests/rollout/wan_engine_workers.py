"""Rank function for tests/rollout/test_sglang_engine_wan.py: the megatron Wan trainer (the run's own
``build_trainer``, model.family = "wan", fp32) replays SGLang Wan trajectories through FlowGRPO's microbatches and
reports how far its per-step log-probs are from the engine's. Module-level: pickled by reference into the rank."""
from __future__ import annotations

import dataclasses

import megaflow  # noqa: F401  (import guards before megatron)
import torch


def _max_log_prob_diff(eng, trajs) -> float:
    """max over every (sample, stochastic step) of |trainer log-prob - engine log-prob| (one rank: the last stage)."""
    from megaflow.testing.reference import transition_config
    from megaflow.trainer.batch import batch_conditioning
    from megaflow.trainer.flowgrpo import _policy
    from megaflow.trainer.flowgrpo_batches import microbatches_for

    transition = transition_config(trajs[0])
    window = [t for t in range(trajs[0].num_steps) if bool(trajs[0].sde_mask[t])]
    items = [(i, t) for i in range(len(trajs)) for t in window]
    mbs = microbatches_for(trajs, torch.zeros(len(trajs)), items, 2, torch.device("cpu"),
                           conditioning=batch_conditioning(eng))
    diffs = [(_policy(v, mb, transition).log_prob - mb["rollout_log_prob"]).abs()[mb["real"]]
             for mb, v in zip(mbs, eng.forward_backward(mbs, None, forward_only=True))]
    return float(torch.cat(diffs).max())


def _other_prompts(trajs):
    """The same samples, each replayed with the next sample's text conditioning (the control)."""
    return [dataclasses.replace(t, conditioning=trajs[(i + 1) % len(trajs)].conditioning) for i, t in enumerate(trajs)]


def trainer_log_prob_rank(pipeline_dir: str, trajs_paths: dict[str, str]) -> dict:
    """{name: max |trainer - engine| log-prob} per saved batch, plus ``<name>/other_prompt`` (the control)."""
    from pathlib import Path

    from megaflow.config import load_config
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed
    from megaflow.run.build import build_trainer

    init_distributed(ParallelDims(tp=1), seed=0)
    eng, _ = build_trainer(load_config(None, ['model.family="wan"']), Path(pipeline_dir))
    out = {}
    for name, path in trajs_paths.items():
        trajs = torch.load(path, weights_only=False)
        out[name] = _max_log_prob_diff(eng, trajs)
        out[f"{name}/other_prompt"] = _max_log_prob_diff(eng, _other_prompts(trajs))
    destroy_distributed()
    return out
