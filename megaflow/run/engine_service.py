"""The engine rank's service under ``rollout.placement = "disaggregated"``: the last ``rollout.engine_ranks``
ranks host engines, train nothing, and follow the driver's commands (megaflow.rollout.engine_commands) until
``stop``, exiting with the trainer ranks, as interrupted when they were.
"""
from __future__ import annotations

from pathlib import Path

from megaflow.config import MegaflowConfig
from megaflow.rollout.engine_commands import Commands, exchange_generated
from megaflow.run.roles import Roles
from megaflow.rundir.interrupt import Interrupted, StopRequests


def serve_engine_rank(cfg: MegaflowConfig, roles: Roles, pipeline_dir: Path, *, stop: StopRequests,
                      verbose: bool = False, warm: dict | None = None) -> None:
    """Build this rank's rollout and weight receiver and follow the driver until it stops the run; raises
    :class:`Interrupted` when a signal ended it."""
    from megaflow.config import run_dir_of
    from megaflow.run.build import build_rollout, build_sync

    hosted = build_rollout(cfg, roles.placement, pipeline_dir, roles.groups, verbose=verbose, warm=warm)
    try:
        sync = build_sync(cfg, hosted, roles.groups, run_dir_of(cfg), pipeline_dir)
        end = follow(hosted, sync, Commands(roles.groups.control))
    finally:
        stop.restore()
        hosted.close()
    if end["interrupted"]:
        raise Interrupted(*end["interrupted"])


def follow(hosted, sync, commands: Commands) -> dict:
    """Follow the driver's commands until ``stop``; returns the stop's payload."""
    while True:
        op, payload = commands.receive()
        if op == "sync":
            sync.push(iter(()))
        elif op == "collect":
            hosted.collect(payload["requests"], payload["iteration"])
        elif op == "generate":
            exchange_generated(commands, hosted.placement.hosts, payload["requests"], hosted.placement.rank,
                               hosted.local)
        elif op == "stop":
            return payload
        else:
            raise ValueError(f"engine rank {hosted.placement.rank}: unknown command {op!r} from the driver")
