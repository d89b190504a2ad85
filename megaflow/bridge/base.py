"""The weight-update bridge interface: ``WeightBridge.push(named_tensors) -> SyncReport`` into ``WeightTarget``s.

A bridge calls only ``WeightTarget`` methods on an engine; sampling is the ``rollout.engine.Sampler``'s role.
Design notes: docs/design/bridge.md.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from megaflow.bridge.buckets import Bucket
from megaflow.checksum import DEFAULT


@dataclass(kw_only=True)
class WeightUpdateResult:
    """Outcome of one weight update into one engine (or any other target the bridge loads)."""

    ok: bool
    """The engine accepted every tensor (an engine must not report ok for names it skipped)."""
    num_tensors: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    message: str = ""


@runtime_checkable
class WeightTarget(Protocol):
    """What a bridge loads weights into (an SGLang engine, a balancer over several, an ``nn.Module``): it takes
    DiT tensors by engine (diffusers state_dict) name and re-hashes what it holds. Every method blocks."""

    engine_id: str

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightUpdateResult:
        """Load tensors given by engine name, e.g. 'transformer_blocks.0.attn.to_q.weight'."""
        ...

    def load_bucket(self, bucket: Bucket, *, digests: dict[str, str] | None = None, checksum: str = DEFAULT
                    ) -> WeightUpdateResult:
        """Load one ``Bucket``; ``digests``: the sender's, checked against the target's re-hash (ok False naming
        mismatches or tensors not loaded). None: no check."""
        ...

    def update_weights_from_disk(self, path: str) -> WeightUpdateResult:
        """Reload the DiT from a diffusers pipeline / transformer directory (all-or-nothing)."""
        ...

    def verify_weights(self, expected_digests: dict[str, str], *, checksum: str = DEFAULT) -> tuple[bool, str]:
        """Re-hash the named tensors held with ``checksum`` (``megaflow.checksum``); (all match, message naming
        the first mismatch)."""
        ...

    def checksum(self) -> str:
        """SHA-256 hex digest over the DiT parameters as the target holds them."""
        ...


class SyncError(RuntimeError):
    """A weight sync did not verify (the engine holds different weights than were sent)."""


@dataclass(kw_only=True)
class SyncReport:
    """What one sync moved and whether it verified."""

    mode: str
    """The path's name: the bridge's ``bridge.mode``, "lora" for the adapters' path, "run" for ``RunSync.push``'s
    report merged over every engine host."""
    num_tensors: int = 0
    num_bytes: int = 0
    num_buckets: int = 0
    seconds: float = 0.0
    verified: bool = False
    """Every tensor was re-hashed by the engine and matched (False when verification was off)."""
    message: str = ""
    checksum: str = DEFAULT
    """The algorithm of ``expected_digests`` (``megaflow.checksum``)."""
    expected_digests: dict[str, str] = field(default_factory=dict, repr=False)
    hosts: int | None = None
    """The engine hosts merged into this report (``RunSync.push``); None for one bridge's own push."""
    hosts_verified: int | None = None
    """Of ``hosts``, those whose engines verified every tensor."""

    def as_metrics(self) -> dict[str, float]:
        """The sync's metrics row: the one place the ``sync/*`` keys are made."""
        metrics = {"sync/seconds": self.seconds, "sync/mbytes": self.num_bytes / 2**20,
                   "sync/tensors": float(self.num_tensors), "sync/verified": float(self.verified)}
        if self.hosts is not None:
            metrics.update({"sync/hosts": float(self.hosts), "sync/hosts_verified": float(self.hosts_verified)})
        return metrics


class WeightBridge(Protocol):
    """One transfer path into the engines."""

    mode: str

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Move every tensor into the engine(s); raise SyncError if verification fails."""
        ...


class SyncStream:
    """Wraps a (name, tensor) stream, counting tensors and bytes as they pass; ``record`` keeps the ``checksum``
    digests of each packed bucket's tensors when ``digest`` (the sync's one hash pass on the sending side)."""

    def __init__(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, digest: bool, checksum: str = DEFAULT):
        self._it = iter(named_tensors)
        self.digest = digest
        self.checksum = checksum
        self.digests: dict[str, str] = {}
        self.num_tensors = 0
        self.num_bytes = 0
        self.started = time.perf_counter()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._it:
            self.num_tensors += 1
            self.num_bytes += t.numel() * t.element_size()
            yield name, t

    def record(self, bucket: Bucket) -> dict[str, str]:
        """Hash the bucket's tensors (only when ``digest``; else nothing, and ``{}`` is returned); returns this
        bucket's digests, also kept in ``digests`` for the whole sync."""
        if not self.digest:
            return {}
        digests = bucket.digests(self.checksum)
        self.digests.update(digests)
        return digests

    def report(self, mode: str, num_buckets: int, *, verified: bool = False, message: str = "") -> SyncReport:
        """The sync's report; ``seconds`` run from the stream's creation to this call."""
        return SyncReport(mode=mode, num_tensors=self.num_tensors, num_bytes=self.num_bytes,
                          num_buckets=num_buckets, seconds=time.perf_counter() - self.started,
                          verified=verified, message=message, checksum=self.checksum,
                          expected_digests=dict(self.digests))


def verify_engines(engines: Sequence[WeightTarget], expected_digests: dict[str, str], checksum: str,
                   pool: ThreadPoolExecutor | None = None) -> str:
    """Ask every engine (in parallel on ``pool`` when given) to re-hash the tensors in ``expected_digests`` with
    ``checksum``; raise SyncError on a mismatch, else return a one-line summary."""
    def check(engine):
        return engine.verify_weights(expected_digests, checksum=checksum)
    results = [check(engine) for engine in engines] if pool is None else list(pool.map(check, engines))
    for engine, (ok, msg) in zip(engines, results):
        if not ok:
            raise SyncError(f"weight sync to engine {getattr(engine, 'engine_id', '?')} did not verify: {msg}")
    return f"verified {len(expected_digests)} tensors on {len(engines)} engine(s)"
