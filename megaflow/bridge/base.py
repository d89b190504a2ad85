"""The weight-update bridge interface: ``push(named_tensors) -> SyncReport``.

The trainer streams ``(engine_name, full_tensor)`` pairs (already gathered over TP/PP and renamed to
the engine's diffusers names, see :func:`megaflow.bridge.convert.engine_named_params`). A bridge
moves them into the rollout engine(s) by one transfer path -- colocated (same host: shared memory /
CUDA IPC), distributed (a process-group broadcast to the rank that hosts the engine) or disk
(safetensors + reload) -- and, with ``verify``, checks the result once per sync: every tensor is
hashed once here while streaming and once by each engine at the end (engines load buckets with
``verify=False``, no per-bucket hashing). Without ``verify`` nothing is hashed at all. The three paths
are three implementations of this one interface, chosen by ``bridge.mode``.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from megaflow.bridge.buckets import tensor_sha256


class SyncError(RuntimeError):
    """A weight sync did not verify (the engine holds different weights than were sent)."""


@dataclass(kw_only=True)
class SyncReport:
    """What one sync moved and whether it verified."""

    mode: str
    num_tensors: int = 0
    num_bytes: int = 0
    num_buckets: int = 0
    seconds: float = 0.0
    verified: bool = False
    """Every tensor was re-hashed by the engine and matched (False when verification was off)."""
    message: str = ""
    expected_sha256: dict[str, str] = field(default_factory=dict, repr=False)

    def as_metrics(self) -> dict[str, float]:
        return {"sync/seconds": self.seconds, "sync/mbytes": self.num_bytes / 2**20,
                "sync/tensors": float(self.num_tensors), "sync/verified": float(self.verified)}


class WeightBridge(Protocol):
    """One transfer path into the engines."""

    mode: str

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Move every tensor into the engine(s); raise SyncError if verification fails."""
        ...


class DigestingStream:
    """Wraps a (name, tensor) stream, recording SHA-256 digests and byte counts as it passes."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, digest: bool):
        self._it = iter(named_tensors)
        self.digest = digest
        self.sha256: dict[str, str] = {}
        self.num_tensors = 0
        self.num_bytes = 0
        self.started = time.perf_counter()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._it:
            t = t.detach()
            if self.digest:
                self.sha256[name] = tensor_sha256(t)
            self.num_tensors += 1
            self.num_bytes += t.numel() * t.element_size()
            yield name, t

    def report(self, mode: str, num_buckets: int) -> SyncReport:
        return SyncReport(mode=mode, num_tensors=self.num_tensors, num_bytes=self.num_bytes,
                          num_buckets=num_buckets, seconds=time.perf_counter() - self.started,
                          expected_sha256=dict(self.sha256))


def verify_engines(engines, report: SyncReport) -> SyncReport:
    """Ask every engine to re-hash the tensors in ``report.expected_sha256``; raise SyncError on mismatch."""
    for engine in engines:
        ok, msg = engine.verify_weights(report.expected_sha256)
        if not ok:
            raise SyncError(f"weight sync to engine {getattr(engine, 'engine_id', '?')} did not verify: {msg}")
    report.verified = True
    report.message = f"verified {len(report.expected_sha256)} tensors on {len(engines)} engine(s)"
    return report
