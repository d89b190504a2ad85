"""Who this process is in a run, and what the ranks agree on before anything is built.

Every rank computes the same Placement from the launch; rank 0 claims the run directory and resolves the
pipeline, and every rank receives the outcome (errors included), so all ranks fail or go on together.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megaflow.config import MegaflowConfig, save_config
from megaflow.config.resume_changes import describe_changes
from megaflow.parallel.groups import RunGroups
from megaflow.parallel.placement import Placement
from megaflow.rundir.claim import RunDir


@dataclass(frozen=True)
class Roles:
    """This rank's place in the run: the placement and megaflow's groups."""

    placement: Placement
    groups: RunGroups

    @property
    def driver(self) -> bool:
        return self.placement.is_driver

    def share(self, obj):
        """``obj`` of the driver on every launched rank."""
        everyone = self.groups.everyone
        return obj if everyone.size == 1 else everyone.broadcast_object(obj if self.driver else None, 0)


@dataclass(frozen=True)
class Claim:
    """The run dir as the driver claimed it: ``owned`` (the driver's RunDir, None elsewhere), the iteration to
    continue after and the checkpoint to continue from (0 and None for a fresh run)."""

    owned: RunDir | None
    start: int
    resume_from: Path | None


def start_roles(cfg: MegaflowConfig) -> Roles:
    """Place this process, join megatron's world (trainer ranks) and build megaflow's groups (every rank)."""
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import current_device, init_distributed
    from megaflow.parallel.groups import run_groups
    from megaflow.parallel.placement import placement_from_env

    p, r = cfg.parallel, cfg.rollout
    placement = placement_from_env(r.engine_hosts, r.num_engines, placement=r.placement, engine_ranks=r.engine_ranks)
    if not placement.is_trainer and torch.cuda.is_available():
        torch.cuda.set_device(current_device())  # the weight receiver's device (engines pin their own)
    if placement.is_trainer:
        init_distributed(ParallelDims.of(p), seed=cfg.run.seed, timeout_s=p.timeout_s, trainers=placement.num_trainers)
    groups = run_groups(placement, weights=cfg.bridge.mode == "distributed", timeout_s=p.timeout_s)
    return Roles(placement, groups)


def claim_run_dir(cfg: MegaflowConfig, roles: Roles, *, resume: bool, overrides: tuple[str, ...] = ()) -> Claim:
    """The driver claims the run dir (lock, history checks) and says in one line what a resume changed; every
    rank gets the outcome or the same error. ``overrides``: config keys a resume may change though they change
    what the run trains (``--resume-override``)."""
    claimed, error = None, None
    if roles.driver:
        try:
            claimed = RunDir(cfg, resume=resume, overrides=overrides)
        except ValueError as e:
            error = str(e)
        if claimed is not None and claimed.changes:
            print(describe_changes(claimed.changes, overrides), flush=True)
    shared = roles.share((error, claimed.resume_iteration if claimed else 0,
                          str(claimed.resume_from) if claimed and claimed.resume_from else None))
    if shared[0] is not None:
        raise ValueError(shared[0])
    return Claim(claimed, shared[1], Path(shared[2]) if shared[2] else None)


def share_pipeline(cfg: MegaflowConfig, run_dir: Path, roles: Roles) -> Path:
    """The pipeline dir every rank trains and samples: the driver saves the config and resolves the pipeline
    (``model.pretrained``, or a tiny one it makes in the run dir), every rank receives its path."""
    from megaflow.run.build import resolve_pipeline
    pipeline_dir = None
    if roles.driver:
        save_config(cfg, run_dir)
        pipeline_dir = resolve_pipeline(cfg, run_dir)
    return Path(roles.share(str(pipeline_dir) if roles.driver else None))
