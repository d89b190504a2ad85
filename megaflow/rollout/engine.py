"""The rollout engine protocol: the one interface the loop, balancer and bridge talk to.

An engine samples trajectories (``generate``), takes new DiT weights (``update_weights`` with
tensors, ``update_weights_from_disk`` with a diffusers-format directory), reports a weight
checksum to verify an update, frees/retakes accelerator memory around training (``release`` /
``resume``), answers ``health`` and stops the processes it started (``shutdown``). The SGLang
implementation is ``megaflow.rollout.sglang.SGLangEngine``; the balancer wraps N engines behind
the same protocol. All methods but ``submit`` are blocking; ``generate`` and ``submit`` are thread-safe
(concurrent callers are allowed, an engine may batch them).
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
        """Load one ``megaflow.bridge.buckets.Bucket`` (flat bytes + metadata) of DiT tensors. ``digests``: the
        sender's digests of the bucket's tensors (``checksum``, ``megaflow.checksum``); the engine re-hashes
        the tensors it now holds and the load fails (ok False, naming them) on a mismatch or a tensor it did not
        load. None: no check and no hashing (the weight bridge then verifies a whole sync once, or not at all)."""
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
