"""Colocated path: engines on this host; buckets go in through shared memory (CUDA IPC on GPU).

Each bucket is packed once -- on CPU into :class:`StagingSlots`, one shared-memory buffer per bucket
position that the bucket at that position reuses in every sync (touched once: no page faults after the
first sync; the engine workers keep it mapped, and an SGLang engine keeps views of it as its replay store
instead of a copy), on GPU on the tensors' own device -- and handed to every engine's ``load_bucket``,
all engines at once from a thread pool; the SGLang adapter sends the bucket
as SGLang's flattened-bucket payload and the engine's workers copy from the shared memory (or the CUDA IPC
handle) into their DiT parameters.

Pipelined: while the engines load bucket k, this thread packs bucket k + 1 (every CPU bucket has its own
memory; a GPU bucket is waited for first, as its device memory may come back for the next one). With
``verify`` this thread hashes each bucket after packing it and hands the digests to every engine with the
bucket (``load_bucket(bucket, digests=...)``): each engine checks what it loaded against them in the same call
(an SGLang engine's worker hashes each tensor as it copies it in; see ``megaflow.rollout.sglang.weight_checks``)
while this thread packs and hashes bucket k + 1 -- each tensor is hashed once here and once by every engine. A
bucket an engine rejects or does not verify stops the sync at once.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megaflow.bridge.base import SyncError, SyncReport, SyncStream
from megaflow.bridge.buckets import StagingSlots, iter_buckets
from megaflow.checksum import DEFAULT


class ColocatedBridge:
    mode = "colocated"

    def __init__(self, engines: Sequence, *, bucket_bytes: int = 64 << 20, verify: bool = True,
                 checksum: str = DEFAULT):
        if not engines:
            raise ValueError("ColocatedBridge needs at least one engine")
        self.engines = list(engines)
        self.bucket_bytes = int(bucket_bytes)
        self.verify = verify
        self.checksum = checksum
        self._staging = StagingSlots()

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
        with ThreadPoolExecutor(len(self.engines), thread_name_prefix="colocated-push") as pool:
            try:
                for bucket in iter_buckets(stream, self.bucket_bytes, staging=self._staging):  # packed while
                    digests = stream.record(bucket)  # the previous bucket loads; hashed with verify
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
