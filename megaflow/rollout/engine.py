"""The rollout engine's two roles, one protocol each: ``Sampler`` (what the loop, hosted rollout and evaluation
call: sample, free / retake memory, health, shutdown) and ``bridge.base.WeightTarget`` (what a bridge calls: load,
verify). ``RolloutEngine`` is both: what the SGLang engine, the diffusers baseline and the balancer implement.
All methods but ``submit`` block; ``generate`` and ``submit`` are thread-safe.
"""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from megaflow.bridge.base import WeightTarget
from megaflow.rollout.types import RolloutRequest, Trajectory


@dataclass(kw_only=True)
class EngineHealth:
    """A cheap liveness report."""

    alive: bool
    """The engine answers requests (its worker processes are running)."""
    engine_id: str = ""
    num_restarts: int = 0
    """Times the engine was restarted after a crash."""
    worker_pids: list[int] = field(default_factory=list)
    detail: str = ""


@runtime_checkable
class Sampler(Protocol):
    """What the loop needs of an engine (or the balancer over several): samples, and its memory and processes."""

    engine_id: str

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        """Sample every request; returns the trajectories of all requests, request order then output index."""
        ...

    def submit(self, requests: Sequence[RolloutRequest]) -> list[Future]:
        """Start sampling every request (as one ``generate`` call would, same batching); one future per
        request, resolving to its trajectories as soon as they are back (e.g. to score a group while the
        others still sample). ``generate`` = wait for all of them."""
        ...

    def release(self) -> None:
        """Free accelerator memory (weights, caches) so the trainer can use it; generate is invalid until resume."""
        ...

    def resume(self) -> None:
        """Retake what release freed."""
        ...

    def health(self) -> EngineHealth:
        ...

    def shutdown(self) -> None:
        """Stop exactly the processes this engine started. Idempotent."""
        ...


@runtime_checkable
class RolloutEngine(Sampler, WeightTarget, Protocol):
    """An engine in both roles: sampled by the loop, loaded by a bridge."""
