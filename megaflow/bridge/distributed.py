"""Distributed path: broadcast buckets over a process group to the ranks that host engines.

Design notes: docs/design/bridge.md.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from megaflow.bridge.base import SyncError, SyncReport, SyncStream, WeightTarget, verify_engines
from megaflow.bridge.buckets import Bucket, StagingBuffer, iter_buckets
from megaflow.checksum import DEFAULT
from megaflow.parallel.groups import as_group


class DistributedBridge:
    """Source side: ``push`` streams buckets to every receiver in ``group`` and into ``engines`` (engines on
    the source rank; none by default)."""

    mode = "distributed"

    def __init__(self, *, group=None, src: int = 0, bucket_bytes: int = 64 << 20, verify: bool = True,
                 device: torch.device | str = "cpu", engines: Sequence[WeightTarget] = (), checksum: str = DEFAULT):
        self.group, self.src, self.engines = as_group(group), src, list(engines)
        self.bucket_bytes, self.verify, self.checksum = int(bucket_bytes), verify, checksum
        self.device = torch.device(device)

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        stream = SyncStream(named_tensors, digest=self.verify, checksum=self.checksum)
        num_buckets, local_error = 0, ""
        for bucket in iter_buckets(stream, self.bucket_bytes):
            num_buckets += 1
            self.group.broadcast_object(bucket.metadata, self.src)
            dist.broadcast(bucket.flat.to(self.device), group=self.group.pg, group_src=self.group.rank_of(self.src))
            stream.record(bucket)
            for engine in self.engines:  # a failure is raised after the receivers finished, never midway
                r = engine.load_bucket(bucket)  # one check per sync below
                if not r.ok and not local_error:
                    local_error = f"engine {getattr(engine, 'engine_id', '?')} bucket {num_buckets}: {r.message}"
        self.group.broadcast_object(None, self.src)
        self.group.broadcast_object((self.checksum, stream.digests) if self.verify else None, self.src)
        if self.verify and self.engines and not local_error:
            try:
                verify_engines(self.engines, stream.digests, self.checksum)
            except SyncError as e:
                local_error = str(e)
        results = [None] * self.group.size
        dist.all_gather_object(results, None, group=self.group.pg)
        failures = [r[1] for r in results if r is not None and not r[0]] + ([local_error] if local_error else [])
        if failures:
            raise SyncError(f"distributed weight sync did not verify on {len(failures)} host(s): {failures[0]}")
        message = (f"verified on {sum(r is not None for r in results)} receiver(s)"
                   f"{' and the source' if self.engines else ''}") if self.verify else ""
        return stream.report(self.mode, num_buckets, verified=self.verify, message=message)


class DistributedReceiver:
    """Receiver side: ``receive`` mirrors one ``push`` and loads buckets into local engines."""

    def __init__(self, engines: Sequence[WeightTarget], *, group=None, src: int = 0,
                 device: torch.device | str = "cpu"):
        self.engines = list(engines)
        self.group, self.src = as_group(group), src
        self.device = torch.device(device)
        self._staging = StagingBuffer(shared=True)  # CPU buckets: engine processes map it without a copy

    def receive(self) -> tuple[bool, str]:
        ok, msg, n = True, "", 0
        with ThreadPoolExecutor(max(1, len(self.engines)), thread_name_prefix="receiver-load") as pool:
            while True:
                meta = self.group.broadcast_object(None, self.src)
                if meta is None:
                    break
                nbytes = meta[-1].end_idx
                flat = (self._staging.take(nbytes) if self.device.type == "cpu"
                        else torch.empty(nbytes, dtype=torch.uint8, device=self.device))
                dist.broadcast(flat, group=self.group.pg, group_src=self.group.rank_of(self.src))
                n += 1
                bucket = Bucket(flat=flat, metadata=meta)  # on self.device: a CUDA bucket goes to engines by IPC
                # every local engine at once; one check per sync below
                for r in pool.map(lambda e: e.load_bucket(bucket), self.engines):
                    if not r.ok and ok:
                        ok, msg = False, f"bucket {n}: {r.message}"
            expected = self.group.broadcast_object(None, self.src)
            if ok and expected is not None:
                try:
                    msg = verify_engines(self.engines, expected[1], expected[0], pool)
                except SyncError as e:
                    ok, msg = False, str(e)
        dist.all_gather_object([None] * self.group.size, (ok, msg), group=self.group.pg)
        return ok, msg
