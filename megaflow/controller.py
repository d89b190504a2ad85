"""The FlowGRPO loop: generate -> reward -> advantages -> train -> sync, every phase a named call.

Rank 0 drives the SGLang engines and the rewards; every trainer rank receives the scored batch
and takes part in the megatron step and in gathering full weights for the sync. Launch:

    megaflow train -c configs/cpu_demo.toml                       # 1 process
    torchrun --nproc-per-node 2 -m megaflow.cli train -c ... --set parallel.tp=2
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from megaflow.algo.advantages import AdvantageConfig, group_advantages
from megaflow.algo.loss import LossConfig, MismatchConfig, train_step_indices
from megaflow.config import MegaflowConfig, save_config
from megaflow.flow.step import TransitionConfig, sample_sde_window
from megaflow.progress import RunReporter
from megaflow.rollout.types import RolloutRequest
from megaflow.trainer.grpo import GRPOSettings, grpo_update

log = logging.getLogger("megaflow")


def sde_window(cfg: MegaflowConfig, iteration: int) -> list[int] | None:
    """The SDE steps of this iteration's rollouts (None = all): ``rollout.sde_window`` as given, or with
    ``rollout.sde_window_size > 0`` a window drawn anew every iteration (FlowGRPO-Fast) from a generator
    seeded by run.seed and the iteration, so every rank computes the same one without communication."""
    r = cfg.rollout
    if r.sde_window_size == 0:
        if r.sde_window_range:
            raise ValueError(f"rollout.sde_window_range = {r.sde_window_range} needs rollout.sde_window_size > 0")
        return list(r.sde_window) or None
    if r.sde_window:
        raise ValueError(f"rollout.sde_window = {r.sde_window} and rollout.sde_window_size = {r.sde_window_size}: "
                         "set one of them (a fixed window or one drawn every iteration)")
    if r.sde_window_range and len(r.sde_window_range) != 2:
        raise ValueError(f"rollout.sde_window_range = {r.sde_window_range}: expected [lo, hi]")
    window_range = tuple(r.sde_window_range) if r.sde_window_range else (0, r.num_steps)
    g = torch.Generator().manual_seed(cfg.run.seed * 1_000_003 + iteration * 10_007 + 1)
    try:
        return sample_sde_window(r.num_steps, r.sde_window_size, window_range=window_range, generator=g)
    except ValueError as e:
        raise ValueError(f"rollout.sde_window_size = {r.sde_window_size} / sde_window_range = "
                         f"{list(window_range)}: {e}") from None


def make_requests(cfg: MegaflowConfig, prompts, iteration: int) -> list[RolloutRequest]:
    r = cfg.rollout
    base = cfg.run.seed * 1_000_003 + iteration * 10_007
    window = sde_window(cfg, iteration)
    return [RolloutRequest(prompt=next(prompts), num_outputs=r.group_size, seed=base + g * r.group_size,
                           num_steps=r.num_steps, height=r.height, width=r.width,
                           guidance_scale=r.guidance_scale, do_cfg=r.guidance_scale > 1.0,
                           sde_type=r.sde_type, noise_level=r.noise_level,
                           sde_step_indices=window, log_prob_no_const=r.log_prob_no_const,
                           max_sequence_length=r.max_sequence_length or None)
            for g in range(r.prompts_per_iter)]


def generate_and_score(rollout, scorer, requests, cfg: MegaflowConfig):
    """Sample every group, score the images, turn rewards into group-normalised advantages."""
    trajs = rollout.generate(requests)
    images = torch.stack([t.image for t in trajs])
    scores = scorer.submit(images, [t.prompt for t in trajs]).result()
    group_ids = torch.tensor([i // cfg.rollout.group_size for i in range(len(trajs))])
    a = cfg.algo
    adv = group_advantages(scores.total, group_ids, AdvantageConfig(
        clip=a.adv_clip, std_scope=a.std_mode, filter_zero_std=a.filter_zero_std))
    metrics = {**scores.summary(), **{f"adv/{k}": v for k, v in adv.stats.items()},
               "adv/dropped_ratio": adv.dropped_ratio}
    return trajs, adv.advantages, adv.keep, metrics


def grpo_settings(cfg: MegaflowConfig) -> GRPOSettings:
    """Trainer settings; also checks the SDE window and trained steps (ValueError before any training)."""
    r, a, t = cfg.rollout, cfg.algo, cfg.train
    transition = TransitionConfig(kind=r.sde_type, noise_level=r.noise_level, no_const=r.log_prob_no_const)
    window_hi = r.sde_window_range[-1] if r.sde_window_range else r.num_steps
    if r.sde_type == "cps" and r.sde_window_size == 1 and window_hi == r.num_steps:
        raise ValueError("rollout.sde_window_size = 1 with cps can draw the last step alone (deterministic, "
                         "nothing to train): use a size >= 2 or sde_window_range ending before num_steps")
    train_steps(cfg, transition, 1)
    mismatch = None if a.mismatch == "none" else MismatchConfig(
        mode=a.mismatch, level=a.mismatch_level, upper=a.mismatch_cap, lower=a.mismatch_floor)
    clip = {"clip_range": a.clip_range} if a.clip_range > 0 else {}  # 0 = auto (flow_grpo's defaults)
    loss = LossConfig.for_transition(r.sde_type, windowed=bool(r.sde_window) or r.sde_window_size > 0,
                                     beta=a.kl_beta, **clip)
    return GRPOSettings(transition=transition, loss=loss, mismatch=mismatch, micro_batch_size=t.micro_batch_size,
                        num_inner_epochs=t.num_inner_epochs, num_minibatches=t.num_minibatches)


def train_steps(cfg: MegaflowConfig, transition: TransitionConfig, iteration: int) -> list[int]:
    """The denoising steps trained in ``iteration`` (its SDE window, or the first timestep_fraction)."""
    return train_step_indices(cfg.rollout.num_steps, transition, sde_window(cfg, iteration),
                              timestep_fraction=cfg.algo.timestep_fraction)


def sync_weights(trainer, bridge) -> dict:
    """Gather full weights (all trainer ranks), push them into the engines (rank 0), verify."""
    from megaflow.runtime import engine_named_params
    stream = engine_named_params(trainer)
    if bridge is None:  # not the driver rank: take part in the gathers only
        for _ in stream:
            pass
        return {}
    return bridge.push(stream).as_metrics()


def _share(obj, rank0: bool):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj if rank0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run(cfg: MegaflowConfig, *, evaluate: Callable[[object, str | int], None] | None = None,
        verbose: bool = False) -> dict:
    """Train for ``train.iterations``; returns the last iteration's metrics. ``evaluate(rollout, when)``
    (rank 0) runs with the engines holding the initial weights (``"before"``), the weights after each
    iteration's sync (``when`` = the iteration number) and the final ones (``"after"``). ``verbose``: the
    engines' logs go to the terminal instead of <run dir>/logs/, and no progress bar."""
    from megaflow import runtime
    from megaflow.colocate import Phases
    from megaflow.parallel import ParallelDims, init_distributed
    from megaflow.rollout.balancer import Balancer

    torch.set_num_threads(cfg.run.num_threads)
    p = cfg.parallel
    init_distributed(ParallelDims(tp=p.tp, pp=p.pp, cp=p.cp, sp=p.sp, vpp=p.vpp or None), seed=cfg.run.seed)
    rank0 = dist.get_rank() == 0
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    pipeline_dir = None
    if rank0:
        save_config(cfg, run_dir)
        pipeline_dir = runtime.resolve_pipeline(cfg, run_dir)
    pipeline_dir = Path(_share(str(pipeline_dir) if rank0 else None, rank0))
    cfg = runtime.with_pipeline_defaults(cfg, pipeline_dir)
    trainer, ref = runtime.build_trainer(cfg, pipeline_dir)
    engines = runtime.build_engines(cfg, pipeline_dir, verbose=verbose) if rank0 else []
    rollout = (Balancer(engines, seed=cfg.run.seed) if len(engines) > 1 else engines[0]) if rank0 else None
    bridge = runtime.build_bridge(cfg, engines, run_dir, pipeline_dir) if rank0 else None
    scorer = runtime.build_scorer(cfg) if rank0 else None
    prompts = runtime.prompt_stream(cfg)
    settings = grpo_settings(cfg)
    phases = Phases(engines, enabled=cfg.bridge.mode == "colocated")
    reporter = RunReporter(run_dir, cfg, enabled=rank0, verbose=verbose, total_iterations=cfg.train.iterations)
    metrics: dict = {}
    first_reward = float("nan")
    try:
        reporter.iteration(0, sync_weights(trainer, bridge))  # engines now hold exactly the trainer's weights
        if evaluate is not None and rank0:
            evaluate(rollout, "before")
        for it in range(1, cfg.train.iterations + 1):
            t0 = time.perf_counter()
            batch = generate_and_score(rollout, scorer, make_requests(cfg, prompts, it), cfg) if rank0 else None
            t_rollout = time.perf_counter() - t0
            trajs, advantages, keep, roll_metrics = _share(batch, rank0)
            with phases.training():
                train_metrics = grpo_update(trainer, trajs, advantages, keep, train_steps(cfg, settings.transition, it),
                                            settings, ref, seed=cfg.run.seed * 1_000_003 + it * 10_007 + 2)
            t_train = time.perf_counter() - t0 - t_rollout
            sync_metrics = sync_weights(trainer, bridge)
            metrics = {**roll_metrics, **{f"train/{k}": v for k, v in train_metrics.items()}, **sync_metrics,
                       **phases.metrics, "time/rollout_s": t_rollout, "time/train_s": t_train,
                       "time/iteration_s": time.perf_counter() - t0}
            if rollout is not None and hasattr(rollout, "metrics"):
                metrics.update(rollout.metrics())
            reporter.iteration(it, metrics, images=[t.image for t in trajs])
            if evaluate is not None and rank0 and it < cfg.train.iterations:
                evaluate(rollout, it)
            if it == 1:
                first_reward = metrics["reward/total"]
        if evaluate is not None and rank0:
            evaluate(rollout, "after")
        if rank0:
            print(f"[megaflow] done: reward {first_reward:.4f} (iteration 1) -> {metrics['reward/total']:.4f} "
                  f"(iteration {cfg.train.iterations}); run dir {run_dir}", flush=True)
    finally:
        for e in engines:
            e.shutdown()
        if scorer is not None:
            scorer.close()
        reporter.close()
    return metrics
