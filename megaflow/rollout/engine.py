"""The rollout engine protocol: the one interface the loop, balancer and bridge talk to.

An engine samples (``generate``), takes weights, reports checksums, frees/retakes memory (``release`` /
``resume``), answers ``health`` and stops its processes (``shutdown``). All methods but ``submit`` block;
``generate`` and ``submit`` are thread-safe.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from megaflow.bridge.base import WeightUpdateResult
from megaflow.checksum import DEFAULT
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
class RolloutEngine(Protocol):
    """What every rollout engine (and the balancer over several) provides."""

    engine_id: str

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        """Sample every request; returns the trajectories of all requests, request order then output index."""
        ...

    def submit(self, requests: Sequence[RolloutRequest]) -> list[Future]:
        """Start sampling every request (as one ``generate`` call would, same batching); one future per
        request, resolving to its trajectories as soon as they are back (e.g. to score a group while the
        others still sample). ``generate`` = wait for all of them."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightUpdateResult:
        """Load DiT tensors given by engine (diffusers state_dict) names, e.g. 'transformer_blocks.0.attn.to_q.weight'."""
        ...

    def load_bucket(self, bucket, *, digests: dict[str, str] | None = None, checksum: str = DEFAULT
                    ) -> WeightUpdateResult:
        """Load one ``Bucket`` of DiT tensors; ``digests``: the sender's, checked against the engine's re-hash (ok False
        naming mismatches or tensors not loaded). None: no check."""
        ...

    def verify_weights(self, expected_digests: dict[str, str], *, checksum: str = DEFAULT) -> tuple[bool, str]:
        """Re-hash the named tensors the engine holds with ``checksum`` (``megaflow.checksum``);
        (all match, message naming the first mismatch)."""
        ...

    def update_weights_from_disk(self, path: str) -> WeightUpdateResult:
        """Reload the DiT from a diffusers pipeline / transformer directory (all-or-nothing)."""
        ...

    def checksum(self) -> str:
        """SHA-256 hex digest over the DiT parameters as the engine holds them."""
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
