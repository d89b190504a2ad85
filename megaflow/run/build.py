"""The one composition root: a validated config becomes this rank's running pieces.

:func:`build_run` builds a trainer rank's :class:`Run` (trainer, KL reference, EMA, algorithm, rollout, weight
sync, prompts, memory phases, reporter) and the loop's state, both restored when resuming; the component builders
below take the config sections they need and return plain objects that benches and tests use alone.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from megaflow.config import MegaflowConfig, run_dir_of
from megaflow.data.prompts import PromptStream, prompt_pool
from megaflow.parallel.groups import RunGroups
from megaflow.parallel.placement import Placement
from megaflow.run.loop_state import LoopState

if TYPE_CHECKING:  # the builders import these when they build (heavy: megatron, sglang)
    from megaflow.bridge.run_sync import RunSync
    from megaflow.report.progress import RunReporter
    from megaflow.rollout.hosted import HostedRollout
    from megaflow.run.algorithm import Algorithm
    from megaflow.run.phases import Phases
    from megaflow.trainer.shadow import EMA
    from megaflow.trainer.runner import BaseReference, ReferenceModel, Trainer


@dataclass
class Run:
    """What one trainer rank runs: the built pieces :func:`megaflow.run.loop.loop` drives. They stay the same
    objects for the whole run; what changes per iteration is the loop's (megaflow.run.loop_state.LoopState)."""

    cfg: MegaflowConfig
    """The run's config, with the pipeline's defaults applied (:func:`with_pipeline_defaults`)."""
    run_dir: Path
    placement: Placement
    trainer: Trainer
    reference: ReferenceModel | BaseReference | None
    """The KL reference (under LoRA the trainer with its adapters off); None without KL (``algo.kl_beta`` 0)."""
    rollout: HostedRollout
    """This rank's part of the rollout: every rank gets every iteration's scored samples through it."""
    sampler: object | None
    """What the driver evaluates with: its own engines, or the engine ranks' (``RemoteEngines``)."""
    sync: RunSync
    """This rank's side of the weight sync to every engine host."""
    prompts: PromptStream
    algorithm: Algorithm
    """What to sample, how to update, what the engines hold (``algo.name``: megaflow.run.algorithm)."""
    ema: EMA | None
    """The EMA of the trained weights (``train.ema_decay``), which evaluation and export read; None when off."""
    phases: Phases
    """The engines' accelerator memory, released around training (a phased run on GPU), and the trainer's offload
    outside training (``train.offload``)."""
    reporter: RunReporter
    """Metrics, progress, curves and samples (written by the driver)."""
    diffusers_config: dict
    """The pipeline's transformer config, written into every checkpoint."""

    def close(self) -> None:
        """Stop the engines and the scorer, close the reporter."""
        self.rollout.close()
        self.reporter.close()


def build_run(cfg: MegaflowConfig, placement: Placement, groups: RunGroups, *, pipeline_dir: Path, start: int = 0,
              resume_from: Path | None = None, verbose: bool = False, trust_checkpoint: bool = False,
              warm: dict | None = None) -> tuple[Run, LoopState]:
    """This trainer rank's :class:`Run` of ``cfg`` on ``pipeline_dir`` and the loop's state to continue from:
    resumed from ``resume_from`` (after iteration ``start``) when given, else a fresh run's; ``warm``: engine
    workers from :func:`start_engine_workers`."""
    from megaflow.report.metrics import write_metrics_rows
    from megaflow.report.progress import RunReporter
    from megaflow.run.ahead import read_batch
    from megaflow.run.algorithm import build_algorithm
    from megaflow.run.phases import Phases

    run_dir, driver = run_dir_of(cfg), placement.is_driver
    dconfig = json.loads((pipeline_dir / "transformer" / "config.json").read_text())
    trainer, reference = build_trainer(cfg, pipeline_dir)
    ema = build_ema(cfg, trainer)
    algorithm = build_algorithm(cfg, trainer, reference, ema)
    history, consumed = restore(trainer, resume_from, start, driver=driver, shadows=run_shadows(algorithm, ema),
                                trust=trust_checkpoint)
    state = LoopState(iteration=start, history=history, engine_version=start,
                      next_batch=read_batch(resume_from) if resume_from is not None else None)
    rollout = build_rollout(cfg, placement, pipeline_dir, groups, verbose=verbose, warm=warm)
    try:
        sampler = rollout.local
        if sampler is None and rollout.commands is not None:
            from megaflow.rollout.engine_commands import RemoteEngines
            sampler = RemoteEngines(rollout.commands, placement.engine_ranks)
        sync = build_sync(cfg, rollout, groups, run_dir, pipeline_dir)
        prompts = prompt_stream(cfg, consumed)
        # the asynchronous loop samples while it trains: the engines keep their memory
        phases = Phases(rollout.engines, enabled=cfg.phased,
                        trainer=trainer_offload(cfg, trainer))
        evaluations: list[dict] = []
        if driver:
            write_metrics_rows(run_dir, history)  # a resumed run continues the checkpoint's record exactly
            if start:
                from megaflow.rundir.eval_log import resume_eval_log
                evaluations = resume_eval_log(run_dir, start)  # and its evaluations: no second "after"
        reporter = RunReporter(run_dir, cfg, enabled=driver, verbose=verbose, total_iterations=cfg.train.iterations,
                               start_iteration=start, evaluations=evaluations)
    except BaseException:
        rollout.close()
        raise
    return Run(cfg=cfg, run_dir=run_dir, placement=placement, trainer=trainer, reference=reference, rollout=rollout,
               sampler=sampler, sync=sync, prompts=prompts, algorithm=algorithm, ema=ema, phases=phases,
               reporter=reporter, diffusers_config=dconfig), state


def trainer_offload(cfg: MegaflowConfig, trainer):
    """What moves the trainer's parts off its device outside training (``train.offload``; None: "none")."""
    if cfg.train.offload == "none":
        return None
    from megaflow.trainer.offload import TrainerOffload
    return TrainerOffload(trainer, cfg.train.offload)


def build_ema(cfg: MegaflowConfig, trainer):
    """The EMA of the trainer's trainable weights with ``train.ema_decay`` (None when 0)."""
    if cfg.train.ema_decay == 0:
        return None
    from megaflow.trainer.shadow import EMA
    return EMA.of(trainer.chunks, cfg.train.ema_decay)


def run_shadows(algorithm, ema) -> dict:
    """Every shadow weight set of a run by checkpoint name: the algorithm's and the EMA ("ema")."""
    return {**algorithm.shadows(), **({"ema": ema} if ema is not None else {})}


def restore(trainer, resume_from: Path | None, start: int, *, driver: bool,
            shadows: dict | None = None, trust: bool = False) -> tuple[list[dict], int]:
    """(metrics rows so far, prompts consumed): the checkpoint's, loaded into ``trainer`` and ``shadows``
    (collective), or a fresh run's ([], 0) when ``resume_from`` is None."""
    if resume_from is None:
        return [], 0
    from megaflow.rundir.checkpoint_io import load
    t_load = time.perf_counter()
    state = load(trainer, resume_from, shadows=shadows, trust=trust)
    if driver:
        print(f"[megaflow] resuming after iteration {start} from {resume_from} "
              f"(loaded in {time.perf_counter() - t_load:.2f} s)", flush=True)
    return state["metrics"], state["prompts_consumed"]


def prompt_stream(cfg: MegaflowConfig, consumed: int = 0) -> PromptStream:
    """The run's prompt stream (``data.prompts``), advanced past ``consumed`` prompts."""
    d = cfg.data
    return PromptStream(prompt_pool(d.prompts, seed=cfg.run.seed, categories=d.shapes_categories), cfg.run.seed,
                        consumed)


def resolve_pipeline(cfg: MegaflowConfig, run_dir: Path) -> Path:
    """The diffusers pipeline dir to train: ``model.pretrained``, or a tiny one made for this run."""
    if cfg.model.pretrained:
        path = Path(cfg.model.pretrained)
        if not (path / "transformer" / "config.json").is_file():
            raise ValueError(f"model.pretrained: {path} has no transformer/config.json")
        from megaflow.config.remote_code import refuse_remote_code
        refuse_remote_code(path, "model.pretrained", trust=cfg.model.trust_remote_code)  # trainer and engines load it
        return path
    from megaflow.models.tiny_pipeline import make_tiny_pipeline
    path = run_dir / "tiny-pipeline"
    if not (path / "model_index.json").is_file():
        make_tiny_pipeline(cfg.model.family, path, seed=cfg.run.seed)
    return path


def with_pipeline_defaults(cfg: MegaflowConfig, pipeline_dir: Path) -> MegaflowConfig:
    """``cfg`` with ``rollout.max_sequence_length`` = the pipeline's declared prompt length when left at 0."""
    import dataclasses

    from megaflow.models.pipeline_meta import declared_text_len
    declared = declared_text_len(pipeline_dir)
    if cfg.rollout.max_sequence_length or declared is None:
        return cfg
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, max_sequence_length=declared))


def build_trainer(cfg: MegaflowConfig, pipeline_dir: Path):
    """(Trainer with optimizer, KL reference or None) loaded from the pipeline's DiT (and ``lora.init``); the
    reference is a frozen ReferenceModel, or under LoRA the trainer with adapters off (``BaseReference``)."""
    from safetensors.torch import load_file

    from megaflow.models.common.finite import refuse_non_finite
    from megaflow.models.registry import get_family
    from megaflow.trainer.runner import BaseReference, ReferenceModel, Trainer
    from megaflow.trainer.settings import lora_settings, lr_schedule, optimizer_config, transformer_kwargs

    family = get_family(cfg.model.family)
    tdir = pipeline_dir / "transformer"
    mcfg = family.config_from_diffusers(tdir / "config.json", **transformer_kwargs(cfg))
    files = sorted(tdir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {tdir}")
    state = {k: v for f in files for k, v in load_file(str(f)).items()}
    refuse_non_finite(state.items(), str(tdir))
    opt = optimizer_config(cfg)
    lora = lora_settings(cfg)
    trainer = Trainer(mcfg, family=cfg.model.family, spec=cfg.model.spec, optimizer_config=opt, lora=lora,
                      lr_schedule=lr_schedule(cfg))
    trainer.load_diffusers_state_dict(state)
    if lora is not None and cfg.lora.init:
        from megaflow.models.common.lora_files import read_adapter
        trainer.load_adapters(read_adapter(cfg.lora.init, rank=lora.rank, alpha=lora.alpha))
    ref = None
    if cfg.algo.kl_beta > 0 and lora is not None:
        ref = BaseReference(trainer)  # the base = the trainer with its adapters off: no second model
    elif cfg.algo.kl_beta > 0:
        ref = ReferenceModel(mcfg, family=cfg.model.family, spec=cfg.model.spec)
        ref.load_diffusers_state_dict(state)
    return trainer, ref


def _engine_configs(cfg: MegaflowConfig, pipeline_dir: Path | None, placement, *, verbose: bool,
                    announce: bool) -> list:
    """The SGLangEngineConfig of every engine this rank hosts (``pipeline_dir`` None: not known yet)."""
    from megaflow.parallel.placement import placement_from_env
    from megaflow.rollout.sglang.config import engine_config

    placement = placement or placement_from_env("rank0", cfg.rollout.num_engines, env={})
    device = placement.device_index if torch.cuda.is_available() else None
    ids = placement.engine_ids()
    if ids and placement.is_driver and announce:  # the ~20 s of a start (CPU) are no silence
        print(f"[megaflow] starting {len(ids)} SGLang engine(s) on this rank (logs: "
              f"{'the terminal' if verbose else run_dir_of(cfg) / 'logs'}) ...", flush=True)
    return [engine_config(cfg, str(pipeline_dir or ""), engine_id, device_index=device, verbose=verbose)
            for engine_id in ids]


def start_engine_workers(cfg: MegaflowConfig, placement, *, verbose: bool = False) -> dict:
    """Start the worker of every engine this rank hosts before its pipeline exists, by engine id ({} on a rank
    hosting none); the caller discards the workers no engine took (``WarmWorker.discard``)."""
    from megaflow.rollout.sglang.warm import WarmWorker

    workers: dict = {}
    try:
        for c in _engine_configs(cfg, None, placement, verbose=verbose, announce=True):
            log_file = Path(c.log_dir) / f"{c.engine_id}.log" if c.log_dir else None
            workers[c.engine_id] = WarmWorker.start(log_file=log_file, device_index=c.device_index,
                                                    num_threads=c.num_threads, checksum=c.checksum)
    except BaseException:
        for worker in workers.values():
            worker.discard()
        raise
    return workers


def build_engines(cfg: MegaflowConfig, pipeline_dir: Path, placement=None, *, verbose: bool = False,
                  warm: dict | None = None) -> list:
    """The SGLang engines this rank hosts (``rollout.num_engines`` on an engine host, none elsewhere), pinned to
    its local GPU when CUDA is present; workers taken from ``warm`` by engine id."""
    from megaflow.rollout.sglang import SGLangEngine

    warm = warm if warm is not None else {}
    configs = _engine_configs(cfg, pipeline_dir, placement, verbose=verbose, announce=not warm)
    return [SGLangEngine(c, warm=warm.pop(c.engine_id, None)) for c in configs]


def build_rollout(cfg: MegaflowConfig, placement, pipeline_dir: Path, groups, *, verbose: bool = False,
                  warm: dict | None = None):
    """This rank's HostedRollout: its engines (behind a Balancer when several), scorer, gloo group and, on a
    disaggregated driver, the commands to the engine ranks."""
    from megaflow.rollout.balancer import Balancer
    from megaflow.rollout.engine_commands import Commands
    from megaflow.rollout.hosted import HostedRollout
    engines = build_engines(cfg, pipeline_dir, placement, verbose=verbose, warm=warm)
    local = (Balancer(engines, seed=cfg.run.seed) if len(engines) > 1 else engines[0]) if engines else None
    scorer = build_scorer(cfg) if engines else None
    commands = Commands(groups.control) if groups.control is not None and placement.is_driver else None
    return HostedRollout(placement, engines=engines, local=local, scorer=scorer, group=groups.everyone,
                         seed=cfg.run.seed, commands=commands)


def build_bridge(cfg: MegaflowConfig, engines: list, run_dir: Path, pipeline_dir: Path):
    """The local weight bridge of ``bridge.mode`` (shared_memory or disk) from this rank into ``engines``; under LoRA
    (``lora.rank`` > 0) the adapter bridge (megaflow.bridge.lora: only the adapters move, merged by the engines)."""
    b = cfg.bridge
    nbytes = int(b.bucket_mb * 2**20)
    if cfg.lora.rank > 0:  # preflight: only with bridge.mode = shared_memory
        from megaflow.bridge.lora import LoRABridge
        return LoRABridge(engines, alpha=cfg.lora.alpha, rank=cfg.lora.rank, verify=b.verify)
    if b.mode == "shared_memory":
        from megaflow.bridge.shared_memory import SharedMemoryBridge
        return SharedMemoryBridge(engines, bucket_bytes=nbytes, verify=b.verify, checksum=b.checksum)
    if b.mode == "disk":
        from megaflow.bridge.disk import DiskBridge
        tconf = json.loads((pipeline_dir / "transformer" / "config.json").read_text())
        return DiskBridge(engines, run_dir / "weights", transformer_config=tconf, bucket_bytes=nbytes,
                          verify=b.verify, checksum=b.checksum)
    raise ValueError(f"bridge.mode = {b.mode!r} has no local bridge (see build_sync)")


def build_sync(cfg: MegaflowConfig, rollout, groups, run_dir: Path, pipeline_dir: Path):
    """The RunSync of this rank for ``rollout`` (a HostedRollout). bridge.mode = distributed streams over
    ``groups.weights`` (rank 0 and the engine hosts: NCCL with device tensors on GPU, else gloo)."""
    from megaflow.bridge.run_sync import RunSync
    from megaflow.parallel.placement import DRIVER
    p, b = rollout.placement, cfg.bridge
    targets = [rollout.local] if rollout.local is not None else []
    if b.mode != "distributed":
        bridge = build_bridge(cfg, targets, run_dir, pipeline_dir) if targets else None
        return RunSync(p, group=groups.everyone, bridge=bridge)
    from megaflow.bridge.distributed import DistributedBridge, DistributedReceiver
    from megaflow.parallel.distributed import current_device
    device = current_device() if torch.cuda.is_available() else torch.device("cpu")
    if p.is_driver:
        return RunSync(p, group=groups.everyone, commands=rollout.commands, bridge=DistributedBridge(
            group=groups.weights, src=DRIVER, bucket_bytes=int(b.bucket_mb * 2**20), verify=b.verify,
            device=device, engines=targets, checksum=b.checksum))
    receiver = DistributedReceiver(targets, group=groups.weights, src=DRIVER, device=device) if p.is_host else None
    return RunSync(p, group=groups.everyone, receiver=receiver)


def build_scorer(cfg: MegaflowConfig):
    """The reward scorer of ``reward`` (the weighted rewards, scored on ``reward.num_workers`` threads, each
    component bounded by ``reward.timeout_s``)."""
    from megaflow.rewards.registry import build_multi_reward
    from megaflow.rewards.scorer import AsyncScorer
    reward = build_multi_reward(cfg.reward.weights, kwargs=cfg.reward.kwargs, timeout_s=cfg.reward.timeout_s,
                                frames=cfg.reward.frames)
    return AsyncScorer(reward, num_workers=cfg.reward.num_workers)
