"""Colocated path: engines on this host; buckets go in through shared memory (CUDA IPC on GPU).

Each bucket is packed once -- into one shared-memory staging buffer on CPU that every bucket of every sync
reuses (touched once: no page faults after the first sync), on the tensors' own device on GPU -- and handed
to every engine's ``load_bucket`` (without a per-bucket check), all engines at once from a thread pool;
the SGLang adapter sends the bucket as SGLang's flattened-bucket payload and the engine's workers map the
shared memory (or open the CUDA IPC handle) and copy into their DiT parameters. While the engines load a
bucket, this thread hashes it (with ``verify``), so each tensor is hashed once here and once by every
engine at the end of the sync, the engines again in parallel. The next bucket is packed only once every
engine is done with this one. Extra memory: the staging buffer, the size of the largest bucket.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from megaflow.bridge.base import SyncError, SyncReport, SyncStream, verify_engines
from megaflow.bridge.buckets import StagingBuffer, iter_buckets


class ColocatedBridge:
    mode = "colocated"

    def __init__(self, engines: Sequence, *, bucket_bytes: int = 64 << 20, verify: bool = True):
        if not engines:
            raise ValueError("ColocatedBridge needs at least one engine")
        self.engines = list(engines)
        self.bucket_bytes = int(bucket_bytes)
        self.verify = verify
        self._staging = StagingBuffer(shared=True)

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        stream = SyncStream(named_tensors, digest=self.verify)
        num_buckets = 0
        with ThreadPoolExecutor(len(self.engines), thread_name_prefix="colocated-push") as pool:
            for bucket in iter_buckets(stream, self.bucket_bytes, staging=self._staging):
                num_buckets += 1
                loads = [pool.submit(engine.load_bucket, bucket, verify=False) for engine in self.engines]
                stream.record(bucket)  # hashed while the engines load it; one check per sync below
                for engine, load in zip(self.engines, loads):
                    result = load.result()
                    if not result.ok:
                        raise SyncError(f"engine {getattr(engine, 'engine_id', '?')} rejected bucket "
                                        f"{num_buckets}: {result.message}")
            if num_buckets == 0:
                raise ValueError("weight sync got no tensors")
            message = verify_engines(self.engines, stream.sha256, pool) if self.verify else ""
        return stream.report(self.mode, num_buckets, verified=self.verify, message=message)
