"""Build the runtime pieces of a run from a validated config (the only place that does).

Trainer (megatron TrainEngine, + frozen reference when KL is on), this rank's rollout engines (SGLang,
DP replicas behind the least-loaded balancer, on the ranks megaflow.placement names), the weight sync,
the reward scorer and the prompt stream. Every builder takes the config sections it needs and returns
plain objects; the controller composes them.
"""
from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import torch

from megaflow.config.schema import MegaflowConfig

log = logging.getLogger("megaflow")


def resolve_pipeline(cfg: MegaflowConfig, run_dir: Path) -> Path:
    """The diffusers pipeline dir to train: ``model.pretrained``, or a tiny one made for this run."""
    if cfg.model.pretrained:
        path = Path(cfg.model.pretrained)
        if not (path / "transformer" / "config.json").is_file():
            raise ValueError(f"model.pretrained: {path} has no transformer/config.json")
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
    """(TrainEngine with optimizer, the KL reference when algo.kl_beta > 0 else None), loaded from the pipeline's
    DiT (and ``lora.init``). The reference: a frozen ReferenceEngine (the trainer's TP/PP layout, no DDP, grad
    buffer or optimizer), or under LoRA the trainer itself with its adapters off (``BaseReference``)."""
    from safetensors.torch import load_file

    from megaflow.models.registry import get_family
    from megaflow.trainer.engine import BaseReference, ReferenceEngine, TrainEngine

    from megaflow.config.to_megatron import optimizer_config, transformer_kwargs
    family = get_family(cfg.model.family)
    tdir = pipeline_dir / "transformer"
    mcfg = family.config_from_diffusers(tdir / "config.json", **transformer_kwargs(cfg))
    files = sorted(tdir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no safetensors weights in {tdir}")
    state = {k: v for f in files for k, v in load_file(str(f)).items()}
    opt = optimizer_config(cfg)
    lora = lora_settings(cfg)
    trainer = TrainEngine(mcfg, family=cfg.model.family, spec=cfg.model.spec, optimizer_config=opt, lora=lora)
    trainer.load_diffusers_state_dict(state)
    if lora is not None and cfg.lora.init:
        from megaflow.models.common.lora_files import read_adapter
        trainer.load_adapters(read_adapter(cfg.lora.init, rank=lora.rank, alpha=lora.alpha))
    ref = None
    if cfg.algo.kl_beta > 0 and lora is not None:
        ref = BaseReference(trainer)  # the base = the trainer with its adapters off: no second model
    elif cfg.algo.kl_beta > 0:
        ref = ReferenceEngine(mcfg, family=cfg.model.family, spec=cfg.model.spec)
        ref.load_diffusers_state_dict(state)
    return trainer, ref


def lora_settings(cfg: MegaflowConfig):
    """The trainer's LoRA settings from ``lora`` (None for full-parameter training, ``lora.rank`` 0); the
    adapters' A is drawn from ``run.seed``."""
    if cfg.lora.rank == 0:
        return None
    from megaflow.config.sections import from_section
    from megaflow.models.common.lora import LoRASettings
    return from_section(LoRASettings, cfg.lora, seed=cfg.run.seed)


def build_engines(cfg: MegaflowConfig, pipeline_dir: Path, placement=None, *, verbose: bool = False) -> list:
    """The SGLang engines this rank hosts (``placement``: megaflow.placement.Placement; None = a 1-process
    run's): ``rollout.num_engines`` on an engine host, pinned to its local GPU when CUDA is present, none
    elsewhere (each starts its own worker processes); their logs go to <run dir>/logs/, or with ``verbose``
    to the terminal."""
    from megaflow.config.to_sglang import engine_config
    from megaflow.placement import placement_from_env
    from megaflow.rollout.sglang import SGLangEngine
    placement = placement or placement_from_env("rank0", cfg.rollout.num_engines, env={})
    device = placement.device_index if torch.cuda.is_available() else None
    return [SGLangEngine(engine_config(cfg, str(pipeline_dir), engine_id, device_index=device, verbose=verbose))
            for engine_id in placement.engine_ids()]


def build_rollout(cfg: MegaflowConfig, placement, pipeline_dir: Path, groups, *, verbose: bool = False):
    """This rank's HostedRollout: its engines behind one Balancer (several) or alone, its scorer, the gloo
    group over every launched rank, and on a disaggregated driver the commands to the engine-only ranks
    (``groups``: megaflow.parallel.groups.RunGroups)."""
    from megaflow.rollout.balancer import Balancer
    from megaflow.rollout.dedicated import Commands
    from megaflow.rollout.hosted import HostedRollout
    engines = build_engines(cfg, pipeline_dir, placement, verbose=verbose)
    local = (Balancer(engines, seed=cfg.run.seed) if len(engines) > 1 else engines[0]) if engines else None
    scorer = build_scorer(cfg) if engines else None
    commands = Commands(groups.control) if groups.control is not None and placement.is_driver else None
    return HostedRollout(placement, engines=engines, local=local, scorer=scorer, group=groups.everyone,
                         seed=cfg.run.seed, commands=commands)


def build_bridge(cfg: MegaflowConfig, engines: list, run_dir: Path, pipeline_dir: Path):
    """The local weight bridge of ``bridge.mode`` (colocated or disk) from this rank into ``engines``; under LoRA
    (``lora.rank`` > 0) the adapter bridge (megaflow.bridge.lora: only the adapters move, merged by the engines)."""
    b = cfg.bridge
    nbytes = int(b.bucket_mb * 2**20)
    if cfg.lora.rank > 0:  # preflight: only with bridge.mode = colocated
        from megaflow.bridge.lora import LoRABridge
        return LoRABridge(engines, alpha=cfg.lora.alpha, rank=cfg.lora.rank, verify=b.verify)
    if b.mode == "colocated":
        from megaflow.bridge.colocated import ColocatedBridge
        return ColocatedBridge(engines, bucket_bytes=nbytes, verify=b.verify)
    if b.mode == "disk":
        from megaflow.bridge.disk import DiskBridge
        tconf = json.loads((pipeline_dir / "transformer" / "config.json").read_text())
        return DiskBridge(engines, run_dir / "weights", transformer_config=tconf, bucket_bytes=nbytes,
                          verify=b.verify)
    raise ValueError(f"bridge.mode = {b.mode!r} has no local bridge (see build_sync)")


def build_sync(cfg: MegaflowConfig, rollout, groups, run_dir: Path, pipeline_dir: Path):
    """The PlacedSync of this rank for ``rollout`` (a HostedRollout). bridge.mode = distributed streams over
    ``groups.weights`` (rank 0 and the engine hosts: NCCL with device tensors on GPU, else gloo)."""
    from megaflow.bridge.placed import PlacedSync
    from megaflow.placement import DRIVER
    p, b = rollout.placement, cfg.bridge
    targets = [rollout.local] if rollout.local is not None else []
    if b.mode != "distributed":
        bridge = build_bridge(cfg, targets, run_dir, pipeline_dir) if targets else None
        return PlacedSync(p, group=groups.everyone, bridge=bridge)
    from megaflow.bridge.distributed import DistributedBridge, DistributedReceiver
    from megaflow.parallel import current_device
    device = current_device() if torch.cuda.is_available() else torch.device("cpu")
    if p.is_driver:
        return PlacedSync(p, group=groups.everyone, commands=rollout.commands, bridge=DistributedBridge(
            group=groups.weights, src=DRIVER, bucket_bytes=int(b.bucket_mb * 2**20), verify=b.verify,
            device=device, engines=targets))
    receiver = DistributedReceiver(targets, group=groups.weights, src=DRIVER, device=device) if p.is_host else None
    return PlacedSync(p, group=groups.everyone, receiver=receiver)


def build_scorer(cfg: MegaflowConfig):
    from megaflow.rewards.registry import build_multi_reward
    from megaflow.rewards.scorer import AsyncScorer
    reward = build_multi_reward(cfg.reward.weights, kwargs=cfg.reward.kwargs)
    return AsyncScorer(reward, num_workers=cfg.reward.num_workers)


class PromptStream:
    """Endless, seeded prompt stream (reshuffled each pass) that counts what it handed out, so a resumed run
    continues at the same prompt: ``PromptStream(pool, seed, consumed=k)`` starts where one that handed
    out k prompts stopped."""

    def __init__(self, pool: list[str], seed: int, consumed: int = 0):
        self._pool, self._rng, self.consumed = pool, random.Random(seed), 0
        self._order: Iterator[str] = iter(())
        for _ in range(consumed):
            next(self)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        try:
            prompt = next(self._order)
        except StopIteration:
            self._order = iter(self._rng.sample(self._pool, len(self._pool)))
            prompt = next(self._order)
        self.consumed += 1
        return prompt


def prompt_stream(cfg: MegaflowConfig, consumed: int = 0) -> PromptStream:
    """The run's prompt stream (``data.prompts``), advanced past ``consumed`` prompts."""
    d = cfg.data
    if d.prompts == "shapes":
        from megaflow.data.shapes import CATEGORIES, sample_prompts
        cats = tuple(d.shapes_categories) or CATEGORIES
        pool = sample_prompts("train", 512, seed=cfg.run.seed, categories=cats)
    else:
        path = Path(d.prompts)
        if not path.is_file():
            raise ValueError(f"data.prompts: no such prompt file {path}")
        pool = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        if not pool:
            raise ValueError(f"data.prompts: {path} has no prompts")
    return PromptStream(pool, cfg.run.seed, consumed)
