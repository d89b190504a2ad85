"""Colocated path: engines on this host; buckets go in through shared memory (CUDA IPC on GPU).

Each bucket is packed once -- on CPU into :class:`StagingSlots`, one shared-memory buffer per bucket
position that the bucket at that position reuses in every sync (touched once: no page faults after the
first sync; the engine workers keep it mapped, and an SGLang engine keeps views of it as its replay store
instead of a copy), on GPU on the tensors' own device -- and handed to every engine's ``load_bucket``
(without a per-bucket check), all engines at once from a thread pool; the SGLang adapter sends the bucket
as SGLang's flattened-bucket payload and the engine's workers copy from the shared memory (or the CUDA IPC
handle) into their DiT parameters.

Pipelined: while the engines load bucket k, this thread packs bucket k + 1 (every CPU bucket has its own
memory; a GPU bucket is waited for first, as its device memory may come back for the next one). With
``verify`` this thread hashes each bucket after packing it, and every engine re-hashes the bucket's tensors
(``verify_weights``) right after loading it -- the engines hash bucket k while this thread hashes bucket
k + 1 -- so each tensor is hashed once here and once by every engine. A mismatch fails the sync once every
bucket has been loaded (as when engines verified at the end); an engine rejecting a bucket stops it at once.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from megaflow.bridge.base import SyncError, SyncReport, SyncStream, verify_engines
from megaflow.bridge.buckets import Bucket, StagingSlots, iter_buckets
from megaflow.bridge.checksum import DEFAULT


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

    def _wait(self, num: int, loads: list[Future], mismatches: list[SyncError]) -> None:
        for engine, load in zip(self.engines, loads):
            result, mismatch = load.result()
            if mismatch is not None:
                mismatches.append(mismatch)
            if not result.ok:
                raise SyncError(f"engine {getattr(engine, 'engine_id', '?')} rejected bucket {num}: {result.message}")

    def _load(self, engine, bucket: Bucket, digests: dict[str, str]):
        """Load then (``digests``) verify one bucket: (load result, the SyncError of a mismatch or None)."""
        result = engine.load_bucket(bucket, verify=False)  # checked below, against this side's digests
        try:
            if result.ok and digests:
                verify_engines([engine], digests, self.checksum)
        except SyncError as e:
            return result, e
        return result, None

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        stream = SyncStream(named_tensors, digest=self.verify, checksum=self.checksum)
        num_buckets = 0
        loading: list[Future] = []
        mismatches: list[SyncError] = []
        with ThreadPoolExecutor(len(self.engines), thread_name_prefix="colocated-push") as pool:
            try:
                for bucket in iter_buckets(stream, self.bucket_bytes, staging=self._staging):  # packed while
                    digests = stream.record(bucket)  # the previous bucket loads; hashed with verify
                    self._wait(num_buckets, loading, mismatches)
                    num_buckets += 1
                    loading = [pool.submit(self._load, engine, bucket, digests) for engine in self.engines]
                    if bucket.slot is None:  # GPU: its device memory may be reused for the next bucket
                        self._wait(num_buckets, loading, mismatches)
                        loading = []
                self._wait(num_buckets, loading, mismatches)
            finally:
                for load in loading:  # on an error: no load still running when push returns
                    load.cancel() or load.exception()
        if num_buckets == 0:
            raise ValueError("weight sync got no tensors")
        if mismatches:
            raise mismatches[0]
        message = f"verified {len(stream.digests)} tensors on {len(self.engines)} engine(s)" if self.verify else ""
        return stream.report(self.mode, num_buckets, verified=self.verify, message=message)
