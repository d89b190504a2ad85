"""The RL loop: generate -> reward -> advantages -> train -> sync, every phase a named call; the algorithm
says what to sample, how to update and what the engines hold. Design notes: docs/design/run.md.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from megaflow.config import MegaflowConfig, run_dir_of
from megaflow.rollout.types import RewardScores
from megaflow.run.ahead import Batch, PendingBatch, start_batch
from megaflow.run.build import Run, build_run, start_engine_workers, with_pipeline_defaults
from megaflow.run.loop_state import LoopState
from megaflow.run.masked import MaskedWatch, UselessRun
from megaflow.run.requests import batch_advantages
from megaflow.run.roles import Claim, claim_run_dir, share_pipeline, start_roles
from megaflow.rundir import faults
from megaflow.rundir.checkpoints import checkpoint_dir
from megaflow.rundir.eval_log import iteration_of
from megaflow.rundir.interrupt import Interrupted, StopRequests

if TYPE_CHECKING:
    from megaflow.report.metrics import Evaluation

Evaluate = Callable[[object, "str | int"], "Evaluation | None"]
"""The driver's evaluation hook ``evaluate(sampler, when)`` (``when``: "before", an iteration or "after"); what it
returns goes to the reporter."""


def run(cfg: MegaflowConfig, *, evaluate: Evaluate | None = None, evaluate_every: int = 0, resume: bool = False,
        resume_overrides: tuple[str, ...] = (), verbose: bool = False, trust_checkpoint: bool = False) -> dict:
    """Train for ``train.iterations``; returns the last iteration's metrics ({} on an engine rank).

    ``evaluate(sampler, when)`` (pass it on every rank) runs "before" (not when resuming), every
    ``evaluate_every``-th iteration and "after", with the EMA when there is one; its Evaluation goes to the reporter.
    ``resume``: continue from the latest checkpoint (manifest checked; ``trust_checkpoint`` to load one without);
    the config may differ where config/resume_changes.py allows, or in the keys named in ``resume_overrides``.
    SIGINT/SIGTERM stop after the current iteration with a checkpoint (:class:`Interrupted`)."""
    torch.set_num_threads(cfg.run.num_threads)
    run_dir = run_dir_of(cfg)
    roles = start_roles(cfg)
    stop = StopRequests()  # on an engine rank a signal waits for the driver's stop
    claim = claim_run_dir(cfg, roles, resume=resume, overrides=resume_overrides)
    done, warm, metrics, the_run = False, {}, {}, None
    try:
        warm = start_engine_workers(cfg, roles.placement, verbose=verbose)  # they import SGLang meanwhile
        pipeline_dir = share_pipeline(cfg, run_dir, roles)
        cfg = with_pipeline_defaults(cfg, pipeline_dir)
        if roles.placement.is_trainer:
            the_run, state = build_run(cfg, roles.placement, roles.groups, pipeline_dir=pipeline_dir,
                                       start=claim.start, resume_from=claim.resume_from, verbose=verbose,
                                       trust_checkpoint=trust_checkpoint, warm=warm)
            metrics = loop(the_run, state, stop=stop, evaluate=evaluate, evaluate_every=evaluate_every, claim=claim)
        else:  # rollout.placement = disaggregated: this rank only samples
            from megaflow.run.engine_service import serve_engine_rank
            serve_engine_rank(cfg, roles, pipeline_dir, stop=stop, verbose=verbose, warm=warm)
        done = True
    finally:
        stop.restore()  # first: a signal while the engines shut down abandons at once
        try:
            if the_run is not None:
                the_run.close()
        finally:
            for worker in warm.values():  # started for an engine that never started (a failure before)
                worker.discard()
            if claim.owned is not None:
                claim.owned.release(failed=not done)
    return metrics


def loop(run: Run, state: LoopState, *, stop: StopRequests, evaluate: Evaluate | None = None,
         evaluate_every: int = 0, claim: Claim | None = None) -> dict:
    """Iterations ``state.iteration + 1 .. train.iterations`` after the initial weight sync; checkpoints, reports,
    evaluates (the driver) and stops at an iteration boundary when ``stop`` agrees; returns the last metrics."""
    cfg, driver = run.cfg, run.placement.is_driver
    metrics: dict = state.history[-1] if state.history else {}
    with run.algorithm.engine_weights():
        initial_sync = sync_weights(run.trainer, run.sync)  # engines now hold exactly what they sample with
    run.phases.synced()
    if state.iteration == 0:
        run.reporter.iteration(0, initial_sync)
        state.history.append({"iteration": 0, **initial_sync})
        if evaluate is not None and driver:
            evaluate_now(run, evaluate, "before")  # every weight set is the initial one here
    watch = MaskedWatch(cfg.train.max_masked_iterations)
    ahead = cfg.train.max_staleness > 0
    for it in range(state.iteration + 1, cfg.train.iterations + 1):
        batch = state.next_batch  # collected ahead: during the last iteration, or before the checkpoint resumed
        if batch is None:
            batch = start_batch(run, it, state.engine_version)
            if ahead:  # the first batch of an asynchronous run, in full before the next one starts
                batch = batch.finish()
        pending = start_batch(run, it + 1, state.engine_version) if ahead and it < cfg.train.iterations else None
        result = iteration(run, it, batch, pending=pending)
        watch.see(result.scores)
        metrics, last = result.metrics, it == cfg.train.iterations
        signum, useless = stop.agreed(), watch.verdict(it, last=last)
        state.done(it, metrics, result.next_batch)
        if last or signum or useless or (cfg.train.save_every and it % cfg.train.save_every == 0):
            with run.phases.resident():  # the optimizer states and weights are saved from the device
                metrics["checkpoint/write_s"] = save(run, state)
        run.reporter.iteration(it, metrics, images=result.images, captions=result.captions)
        if claim is not None and claim.owned is not None:
            claim.owned.first_iteration_done()
        if evaluate is not None and not last and evaluate_every and it % evaluate_every == 0:
            evaluate_weights(run, evaluate, it)  # before a stop, too: a resumed run does not evaluate it again
        if signum:
            interrupted = (signum, it, str(checkpoint_dir(run.run_dir, it)))
            run.rollout.release(interrupted)
            raise Interrupted(*interrupted)
        if useless:
            run.rollout.release()
            raise UselessRun(f"{useless}; checkpoint {checkpoint_dir(run.run_dir, it)}")
    if evaluate is not None:
        evaluate_weights(run, evaluate, "after")
    run.rollout.release()
    if driver:
        rewards = [r["reward/total"] for r in state.history if "reward/total" in r]
        print(f"[megaflow] done: reward {rewards[0]:.4f} (iteration 1) -> {rewards[-1]:.4f} "
              f"(iteration {cfg.train.iterations}); run dir {run.run_dir}", flush=True)
    return metrics


def evaluate_weights(run: Run, evaluate: Evaluate, when: str | int) -> None:
    """The driver's ``evaluate(sampler, when)`` with the engines holding the EMA when there is one; collective."""
    driver = run.placement.is_driver
    if run.ema is None:
        if driver:
            evaluate_now(run, evaluate, when)
        return
    with run.phases.resident():  # the EMA goes into the trainer's weights
        with run.ema.applied():
            sync_weights(run.trainer, run.sync)
        if driver:
            evaluate_now(run, evaluate, when)
        if when != "after":
            with run.algorithm.engine_weights():
                sync_weights(run.trainer, run.sync)


def evaluate_now(run: Run, evaluate: Evaluate, when: str | int) -> None:
    """``evaluate(sampler, when)`` with the engines as they are; its result (if any) to the reporter at the
    step of the iteration it stands for."""
    result = evaluate(run.sampler, when)
    if result is not None:
        run.reporter.evaluation(iteration_of(when, run.cfg.train.iterations), result)


@dataclass(frozen=True)
class IterationResult:
    """What one iteration leaves for the loop."""

    metrics: dict
    scores: RewardScores
    """The batch's rewards (every sample's, masked ones included)."""
    images: list
    captions: list[str]
    """One per image: the prompt and the total reward."""
    next_batch: Batch | None
    """The next iteration's batch, collected meanwhile (asynchronous loop), or None."""


def iteration(run: Run, it: int, batch: Batch | PendingBatch, *,
              pending: PendingBatch | None = None) -> IterationResult:
    """One iteration on this rank: its ``batch`` (finished here when still being collected), advantages, update,
    wait for ``pending`` (the next batch, asynchronous loop), weight sync. Changes no state of the loop's."""
    cfg = run.cfg
    t0 = time.perf_counter()
    if isinstance(batch, PendingBatch):
        batch = batch.finish()
    captions = [f"{t.prompt} | reward {r:.3f}" for t, r in zip(batch.trajs, batch.scores.total.tolist())]
    trajs, advantages, keep, roll_metrics = batch_advantages(batch.trajs, batch.scores, batch.timings, cfg)
    faults.check("rollout", it)
    t_rollout = time.perf_counter() - t0
    with run.phases.training():
        train_metrics = run.algorithm.update(trajs, advantages, keep, it)
    faults.check("train", it)
    t_train = time.perf_counter() - t0 - t_rollout
    ahead = {"rollout/staleness": float(it - 1 - batch.version)} if cfg.train.max_staleness else {}
    next_batch = pending.finish() if pending is not None else None  # the engines are idle from here
    if pending is not None:
        ahead["time/ahead_wait_s"] = time.perf_counter() - t0 - t_rollout - t_train
    with run.algorithm.engine_weights():
        sync_metrics = sync_weights(run.trainer, run.sync, it)
    run.phases.synced()
    metrics = {**roll_metrics, **{f"train/{k}": v for k, v in train_metrics.items()}, **sync_metrics,
               **run.phases.metrics, **ahead, "time/rollout_s": t_rollout, "time/train_s": t_train,
               "time/iteration_s": time.perf_counter() - t0}
    metrics.update(run.rollout.metrics())
    return IterationResult(metrics, batch.scores, [t.image for t in trajs], captions, next_batch)


def save(run: Run, state: LoopState) -> float:
    """Checkpoint ``state`` after its iteration, with the batch collected ahead for the next one (collective over
    the trainer ranks); the seconds it took."""
    from megaflow.run.ahead import write_batch
    from megaflow.run.build import run_shadows
    from megaflow.rundir.checkpoint_io import save as save_state
    ahead = state.next_batch
    return save_state(run.trainer, run.run_dir, state.iteration, family=run.cfg.model.family,
                      diffusers_config=run.diffusers_config, prompts_consumed=run.prompts.consumed,
                      metrics_rows=state.history, keep=run.cfg.train.keep_checkpoints,
                      shadows=run_shadows(run.algorithm, run.ema), checksum=run.cfg.bridge.checksum,
                      algorithm=run.cfg.algo.name, write_extra=None if ahead is None else lambda stage: write_batch(stage, ahead))


def sync_weights(trainer, sync, iteration: int = 0) -> dict:
    """Gather full weights (every rank; under LoRA only the adapters), push them into every engine host's
    engines, verify (``sync``: a megaflow.bridge.run_sync.RunSync); the merged report's metrics on every rank."""
    from megaflow.bridge.lora import sync_stream
    return sync.push(_fault_midway(sync_stream(trainer), iteration)).as_metrics()


def _fault_midway(stream, iteration: int):
    for i, item in enumerate(stream):
        if i == 4:
            faults.check("sync", iteration)
        yield item
