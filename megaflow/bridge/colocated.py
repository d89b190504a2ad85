"""Colocated path: engines on this host; buckets go in through shared memory (CUDA IPC on GPU).

Each bucket is handed to every engine's ``load_bucket`` (without a per-bucket check); the SGLang adapter
serializes it per send (a serialized CPU payload can be consumed only once) and the engine's workers map
the shared memory and copy into their DiT parameters. Peak extra memory is one bucket. With ``verify``
each tensor is hashed once here while streaming and once by every engine at the end of the sync.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from megaflow.bridge.base import DigestingStream, SyncError, SyncReport, verify_engines
from megaflow.bridge.buckets import iter_buckets


class ColocatedBridge:
    mode = "colocated"

    def __init__(self, engines: Sequence, *, bucket_bytes: int = 64 << 20, verify: bool = True):
        if not engines:
            raise ValueError("ColocatedBridge needs at least one engine")
        self.engines = list(engines)
        self.bucket_bytes = int(bucket_bytes)
        self.verify = verify

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        stream = DigestingStream(named_tensors, digest=self.verify)
        num_buckets = 0
        for bucket in iter_buckets(stream, self.bucket_bytes):
            num_buckets += 1
            for engine in self.engines:
                result = engine.load_bucket(bucket, verify=False)  # one check per sync below
                if not result.ok:
                    raise SyncError(f"engine {getattr(engine, 'engine_id', '?')} rejected bucket "
                                    f"{num_buckets}: {result.message}")
        if num_buckets == 0:
            raise ValueError("weight sync got no tensors")
        report = stream.report(self.mode, num_buckets)
        if self.verify:
            verify_engines(self.engines, report)
        return report
