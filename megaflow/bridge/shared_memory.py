"""The shared-memory path (``bridge.mode = "shared_memory"``): an engine host loads its own engines; each bucket goes
in through shared memory (a CUDA IPC handle on GPU), never over the network.

Design notes: docs/design/bridge.md.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megaflow.bridge.base import SyncError, SyncReport, SyncStream, WeightTarget
from megaflow.bridge.buckets import StagingSlots, iter_buckets
from megaflow.checksum import DEFAULT


class SharedMemoryBridge:
    mode = "shared_memory"

    def __init__(self, engines: Sequence[WeightTarget], *, bucket_bytes: int = 64 << 20, verify: bool = True,
                 checksum: str = DEFAULT, staging: StagingSlots | None = None):
        """``staging``: the staging slots to pack into (default: this bridge's own; two bridges pushing the same
        tensors to the same engines may share one set, as ``megaflow bench sync`` does)."""
        if not engines:
            raise ValueError("SharedMemoryBridge needs at least one engine")
        self.engines = list(engines)
        self.bucket_bytes = int(bucket_bytes)
        self.verify = verify
        self.checksum = checksum
        self._staging = StagingSlots() if staging is None else staging

    def _wait(self, num: int, loads: list[Future]) -> None:
        for engine, load in zip(self.engines, loads):
            result = load.result()
            if not result.ok:
                raise SyncError(f"weight sync to engine {getattr(engine, 'engine_id', '?')} failed at bucket {num}: "
                                f"{result.message}")

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        stream = SyncStream(named_tensors, digest=self.verify, checksum=self.checksum)
        num_buckets = 0
        loading: list[Future] = []
        with ThreadPoolExecutor(len(self.engines), thread_name_prefix="shm-push") as pool:
            try:
                for bucket in iter_buckets(stream, self.bucket_bytes, staging=self._staging,  # packed (and hashed,
                                           checksum=self.checksum if self.verify else None):  # with verify)
                    digests = stream.record(bucket)  # while the previous bucket loads
                    self._wait(num_buckets, loading)
                    num_buckets += 1
                    loading = [pool.submit(engine.load_bucket, bucket, digests=digests or None,
                                           checksum=self.checksum) for engine in self.engines]
                    if bucket.slot is None:  # GPU: its device memory may be reused for the next bucket
                        self._wait(num_buckets, loading)
                        loading = []
                self._wait(num_buckets, loading)
            finally:
                for load in loading:  # on an error: no load still running when push returns
                    load.cancel() or load.exception()
        if num_buckets == 0:
            raise ValueError("weight sync got no tensors")
        message = f"verified {len(stream.digests)} tensors on {len(self.engines)} engine(s)" if self.verify else ""
        return stream.report(self.mode, num_buckets, verified=self.verify, message=message)
