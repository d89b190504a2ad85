"""Disk path: write a diffusers ``transformer/`` of safetensors shards, then reload (other hosts; the robust
fallback). Writes are atomic (temp dir renamed); only the newest ``keep`` snapshots stay.
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from megaflow.bridge.base import SyncStream, SyncError, SyncReport, WeightTarget, verify_engines
from megaflow.bridge.buckets import iter_buckets
from megaflow.checksum import DEFAULT


class DiskBridge:
    mode = "disk"

    def __init__(self, engines: Sequence[WeightTarget], root: str | os.PathLike, *,
                 transformer_config: dict | None = None,
                 bucket_bytes: int = 256 << 20, verify: bool = True, keep: int = 1, checksum: str = DEFAULT):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.engines = list(engines)
        self.root = Path(root)
        self.transformer_config = transformer_config
        self.bucket_bytes = int(bucket_bytes)
        self.verify = verify
        self.checksum = checksum
        self.keep = keep
        self._version = 0

    def write_snapshot(self, stream: SyncStream) -> tuple[Path, int]:
        """Write shards into root/sync-XXXXXX/transformer atomically (each shard's tensors recorded in
        ``stream``); returns (dir, num_shards)."""
        self._version += 1
        final = self.root / f"sync-{self._version:06d}"
        tmp = self.root / f".sync-{self._version:06d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "transformer").mkdir(parents=True)
        num = 0
        try:
            for num, bucket in enumerate(iter_buckets(stream, self.bucket_bytes), start=1):
                stream.record(bucket)
                tensors = {n: t.contiguous() for n, t in bucket.unpack()}
                save_file(tensors, str(tmp / "transformer" / f"diffusion_pytorch_model-{num:05d}.safetensors"))
            if num == 0:
                raise ValueError("weight sync got no tensors")
            if self.transformer_config is not None:
                (tmp / "transformer" / "config.json").write_text(json.dumps(self.transformer_config, indent=2))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune()
        return final, num

    def _prune(self) -> None:
        snaps = sorted(p for p in self.root.glob("sync-*") if p.is_dir())
        for old in snaps[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        stream = SyncStream(named_tensors, digest=self.verify, checksum=self.checksum)
        path, num_shards = self.write_snapshot(stream)
        for engine in self.engines:
            result = engine.update_weights_from_disk(str(path))
            if not result.ok:
                raise SyncError(f"engine {getattr(engine, 'engine_id', '?')} failed to load {path.name}: "
                                f"{result.message}")
        message = verify_engines(self.engines, stream.digests, self.checksum) if self.verify else str(path)
        return stream.report(self.mode, num_shards, verified=self.verify, message=message)
