"""The FlowGRPO loop: generate -> reward -> advantages -> train -> sync, every phase a named call.

The engine hosts (megaflow.placement) sample and score their share of the groups; every trainer rank
receives the whole scored batch (megaflow.rollout.hosted), computes the same advantages, takes part in
the megatron step and in the weight sync to every host (megaflow.bridge.placed). Rank 0 (the driver)
owns the run dir, the metrics and evaluation. With ``rollout.placement = "disaggregated"`` the last
``rollout.engine_ranks`` ranks only sample: they follow the driver's commands (megaflow.rollout.dedicated)
and never enter the loop below. Launch:

    megaflow train -c configs/cpu_demo.toml                       # 1 process
    torchrun --nproc-per-node 2 -m megaflow.cli train -c ... --set parallel.tp=2
    NNODES=2 NODE_RANK=<0|1> bash scripts/launch.sh -c ... --set rollout.engine_hosts='"node"'
    NPROC=2 bash scripts/launch.sh -c ... --set rollout.placement='"disaggregated"' --set rollout.engine_ranks=1 \
        --set bridge.mode='"distributed"'
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megaflow import faults
from megaflow.checkpoints import checkpoint_dir
from megaflow.algo.advantages import AdvantageConfig, group_advantages
from megaflow.algo.loss import LossConfig, MismatchConfig, train_step_indices
from megaflow.config import MegaflowConfig, save_config
from megaflow.config.sections import from_section
from megaflow.flow.step import TransitionConfig, sample_sde_window
from megaflow.models.registry import get_family
from megaflow.progress import RunReporter
from megaflow.rewards.scorer import RewardScores
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
    """This iteration's rollout requests; ``rollout.guidance_scale > 1`` turns on CFG unless the model
    family embeds guidance (FLUX.1-dev: the scale is a model input, one branch)."""
    r = cfg.rollout
    base = cfg.run.seed * 1_000_003 + iteration * 10_007
    window = sde_window(cfg, iteration)
    do_cfg = r.guidance_scale > 1.0 and not get_family(cfg.model.family).embedded_guidance
    return [RolloutRequest(prompt=next(prompts), num_outputs=r.group_size, seed=base + g * r.group_size,
                           num_steps=r.num_steps, height=r.height, width=r.width,
                           guidance_scale=r.guidance_scale, do_cfg=do_cfg,
                           sde_type=r.sde_type, noise_level=r.noise_level,
                           sde_step_indices=window, log_prob_no_const=r.log_prob_no_const,
                           max_sequence_length=r.max_sequence_length or None,
                           request_id=f"it{iteration}-g{g}")  # the same on every rank
            for g in range(r.prompts_per_iter)]


def generate_and_score(rollout, scorer, requests, cfg: MegaflowConfig):
    """Sample every group on ``rollout`` (one host's engines), score the images (scoring overlaps sampling,
    :func:`megaflow.rollout.hosted.sample_and_score`), turn rewards into advantages (:func:`batch_advantages`)."""
    from megaflow.rollout.hosted import sample_and_score
    return batch_advantages(*sample_and_score(rollout, scorer, requests), cfg)


def batch_advantages(trajs, scores: RewardScores, timings: dict, cfg: MegaflowConfig):
    """(trajectories, group-normalised advantages, kept mask, metrics) of a scored batch (groups of
    ``rollout.group_size`` consecutive samples); deterministic, so every rank computes the same."""
    group_ids = torch.tensor([i // cfg.rollout.group_size for i in range(len(trajs))])
    adv = group_advantages(scores.total, group_ids, from_section(AdvantageConfig, cfg.algo))
    metrics = {**scores.summary(), **{f"adv/{k}": v for k, v in adv.stats.items()},
               "adv/dropped_ratio": adv.dropped_ratio, **timings}
    return trajs, adv.advantages, adv.keep, metrics


def grpo_settings(cfg: MegaflowConfig) -> GRPOSettings:
    """Trainer settings; also checks the SDE window and trained steps (ValueError before any training)."""
    r, a = cfg.rollout, cfg.algo
    transition = TransitionConfig(kind=r.sde_type, noise_level=r.noise_level, no_const=r.log_prob_no_const)
    window_hi = r.sde_window_range[-1] if r.sde_window_range else r.num_steps
    if r.sde_type == "cps" and r.sde_window_size == 1 and window_hi == r.num_steps:
        raise ValueError("rollout.sde_window_size = 1 with cps can draw the last step alone (deterministic, "
                         "nothing to train): use a size >= 2 or sde_window_range ending before num_steps")
    train_steps(cfg, transition, 1)
    mismatch = None if a.mismatch == "none" else from_section(MismatchConfig, a)
    windowed = bool(r.sde_window) or r.sde_window_size > 0
    clip_range = a.clip_range or LossConfig.auto_clip_range(r.sde_type, windowed=windowed)  # 0 = auto
    loss = from_section(LossConfig, a, clip_range=clip_range)
    return from_section(GRPOSettings, cfg.train, transition=transition, loss=loss, mismatch=mismatch)


def train_steps(cfg: MegaflowConfig, transition: TransitionConfig, iteration: int) -> list[int]:
    """The denoising steps trained in ``iteration`` (its SDE window, or the first timestep_fraction)."""
    return train_step_indices(cfg.rollout.num_steps, transition, sde_window(cfg, iteration),
                              timestep_fraction=cfg.algo.timestep_fraction)


def sync_weights(trainer, sync, iteration: int = 0) -> dict:
    """Gather full weights (every rank; under LoRA only the adapters), push them into every engine host's
    engines, verify (``sync``: a megaflow.bridge.placed.PlacedSync); the merged metrics on every rank."""
    from megaflow.bridge.lora import sync_stream
    return sync.push(_fault_midway(sync_stream(trainer), iteration))


def _fault_midway(stream, iteration: int):
    for i, item in enumerate(stream):
        if i == 4:
            faults.check("sync", iteration)
        yield item


def _share(obj, rank0: bool, group):
    """``obj`` of rank 0 on every launched rank (``group``: the run's ``everyone`` group)."""
    return obj if group.size == 1 else group.broadcast_object(obj if rank0 else None, 0)


def _claim_run_dir(cfg: MegaflowConfig, resume: bool, rank0: bool, group):
    """Rank 0 claims the run dir (lock, history checks); every rank gets the outcome or the same error."""
    from megaflow.rundir import RunDir
    claimed, error = None, None
    if rank0:
        try:
            claimed = RunDir(cfg, resume=resume)
        except ValueError as e:
            error = str(e)
    shared = _share((error, claimed.resume_iteration if claimed else 0,
                     str(claimed.resume_from) if claimed and claimed.resume_from else None), rank0, group)
    if shared[0] is not None:
        raise ValueError(shared[0])
    return claimed, shared[1], Path(shared[2]) if shared[2] else None


def run(cfg: MegaflowConfig, *, evaluate: Callable[[object, str | int], None] | None = None,
        resume: bool = False, verbose: bool = False) -> dict:
    """Train for ``train.iterations``; returns the last iteration's metrics.

    ``evaluate(rollout, when)`` (rank 0) runs with the engines holding the initial weights (``"before"``,
    not when resuming), the weights after each iteration's sync (``when`` = the iteration number) and the
    final ones (``"after"``). ``resume`` continues from the run dir's latest checkpoint (megaflow.rundir
    says when a run dir may be used). Checkpoints every ``train.save_every`` iterations and at the end;
    SIGINT/SIGTERM stop after the current iteration with a checkpoint (:class:`Interrupted`). ``verbose``:
    the engines' logs go to the terminal instead of <run dir>/logs/, and no progress bar."""
    from megaflow import run_state, runtime
    from megaflow.colocate import Phases
    from megaflow.interrupt import Interrupted, StopRequests
    from megaflow.parallel import ParallelDims, init_distributed
    from megaflow.parallel.groups import run_groups
    from megaflow.placement import placement_from_env
    from megaflow.rundir import run_dir_of

    torch.set_num_threads(cfg.run.num_threads)
    run_dir = run_dir_of(cfg)
    p, r = cfg.parallel, cfg.rollout
    placement = placement_from_env(r.engine_hosts, r.num_engines, placement=r.placement, engine_ranks=r.engine_ranks)
    if not placement.is_trainer and torch.cuda.is_available():
        from megaflow.parallel import current_device
        torch.cuda.set_device(current_device())  # the weight receiver's device (engines pin their own)
    if placement.is_trainer:
        init_distributed(ParallelDims(tp=p.tp, pp=p.pp, cp=p.cp, sp=p.sp, vpp=p.vpp or None), seed=cfg.run.seed,
                         timeout_s=p.timeout_s, trainers=placement.num_trainers)
    groups = run_groups(placement, weights=cfg.bridge.mode == "distributed", timeout_s=p.timeout_s)
    rank0 = placement.is_driver
    stop = StopRequests()  # on an engine-only rank a signal waits for the driver's stop
    owned, start, resume_from = _claim_run_dir(cfg, resume, rank0, groups.everyone)
    hosted, reporter, done = None, None, False
    try:
        pipeline_dir = None
        if rank0:
            save_config(cfg, run_dir)
            pipeline_dir = runtime.resolve_pipeline(cfg, run_dir)
        pipeline_dir = Path(_share(str(pipeline_dir) if rank0 else None, rank0, groups.everyone))
        cfg = runtime.with_pipeline_defaults(cfg, pipeline_dir)
        if not placement.is_trainer:  # rollout.placement = disaggregated: this rank only samples
            from megaflow.rollout.dedicated import Commands, serve
            hosted = runtime.build_rollout(cfg, placement, pipeline_dir, groups, verbose=verbose)
            sync = runtime.build_sync(cfg, hosted, groups, run_dir, pipeline_dir)
            end = serve(hosted, sync, Commands(groups.control))
            if end["interrupted"]:
                raise Interrupted(*end["interrupted"])  # exit as the trainer ranks do
            done = True
            return {}
        dconfig = json.loads((pipeline_dir / "transformer" / "config.json").read_text())
        trainer, ref = runtime.build_trainer(cfg, pipeline_dir)
        history: list[dict] = []
        consumed = 0
        if resume_from is not None:
            t_load = time.perf_counter()
            state = run_state.load(trainer, resume_from)
            history, consumed = state["metrics"], state["prompts_consumed"]
            if rank0:
                print(f"[megaflow] resuming after iteration {start} from {resume_from} "
                      f"(loaded in {time.perf_counter() - t_load:.2f} s)", flush=True)
        hosted = runtime.build_rollout(cfg, placement, pipeline_dir, groups, verbose=verbose)
        rollout = hosted.sampler  # the driver's evaluation engines (its own, or the engine-only ranks')
        sync = runtime.build_sync(cfg, hosted, groups, run_dir, pipeline_dir)
        prompts = runtime.prompt_stream(cfg, consumed)
        settings = grpo_settings(cfg)
        phases = Phases(hosted.engines, enabled=cfg.bridge.mode == "colocated")
        if rank0:
            write_metrics_rows(run_dir, history)  # a resumed run continues the checkpoint's record exactly
        reporter = RunReporter(run_dir, cfg, enabled=rank0, verbose=verbose, total_iterations=cfg.train.iterations,
                               start_iteration=start)
        metrics: dict = history[-1] if history else {}
        initial_sync = sync_weights(trainer, sync)  # engines now hold exactly the trainer's weights
        if start == 0:
            reporter.iteration(0, initial_sync)
            history.append({"iteration": 0, **initial_sync})
            if evaluate is not None and rank0:
                evaluate(rollout, "before")

        def save(it: int) -> float:
            return run_state.save(trainer, run_dir, it, family=cfg.model.family, diffusers_config=dconfig,
                                  prompts_consumed=prompts.consumed, metrics_rows=history,
                                  keep=cfg.train.keep_checkpoints)

        for it in range(start + 1, cfg.train.iterations + 1):
            t0 = time.perf_counter()
            trajs, advantages, keep, roll_metrics = batch_advantages(
                *hosted.collect(make_requests(cfg, prompts, it), it), cfg)
            faults.check("rollout", it)
            t_rollout = time.perf_counter() - t0
            with phases.training():
                train_metrics = grpo_update(trainer, trajs, advantages, keep, train_steps(cfg, settings.transition, it),
                                            settings, ref, seed=cfg.run.seed * 1_000_003 + it * 10_007 + 2)
            faults.check("train", it)
            t_train = time.perf_counter() - t0 - t_rollout
            sync_metrics = sync_weights(trainer, sync, it)
            metrics = {**roll_metrics, **{f"train/{k}": v for k, v in train_metrics.items()}, **sync_metrics,
                       **phases.metrics, "time/rollout_s": t_rollout, "time/train_s": t_train,
                       "time/iteration_s": time.perf_counter() - t0}
            metrics.update(hosted.metrics())
            signum = stop.agreed()
            last = it == cfg.train.iterations
            history.append({"iteration": it, **metrics})
            if last or signum or (cfg.train.save_every and it % cfg.train.save_every == 0):
                metrics["checkpoint/write_s"] = save(it)
            reporter.iteration(it, metrics, images=[t.image for t in trajs])
            if owned is not None:
                owned.first_iteration_done()
            if signum:
                interrupted = (signum, it, str(checkpoint_dir(run_dir, it)))
                hosted.release(interrupted)
                raise Interrupted(*interrupted)
            if evaluate is not None and rank0 and not last:
                evaluate(rollout, it)
        if evaluate is not None and rank0:
            evaluate(rollout, "after")
        hosted.release()
        if rank0:
            rewards = [r["reward/total"] for r in history if "reward/total" in r]
            print(f"[megaflow] done: reward {rewards[0]:.4f} (iteration 1) -> {rewards[-1]:.4f} "
                  f"(iteration {cfg.train.iterations}); run dir {run_dir}", flush=True)
        done = True
    finally:
        stop.restore()
        if hosted is not None:
            hosted.close()
        if reporter is not None:
            reporter.close()
        if owned is not None:
            owned.release(failed=not done)
    return metrics


def write_metrics_rows(run_dir: Path, rows: list[dict]) -> None:
    """Replace ``metrics.jsonl`` with ``rows`` atomically (a fresh run: none; a resumed one: the checkpoint's)."""
    path = run_dir / "metrics.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in rows))
    os.replace(tmp, path)
