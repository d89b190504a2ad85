"""A local ``nn.Module`` as a ``WeightTarget`` (the methods a bridge calls on an engine). Loading is all-or-nothing
per bucket: unknown names or shape/dtype mismatches reject it before anything is copied.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from megaflow.bridge.base import WeightUpdateResult
from megaflow.bridge.buckets import Bucket
from megaflow.checksum import DEFAULT, WSUM, device_digest, tensor_digest, weights_checksum


class ModuleTarget:
    """Loads named tensors into ``module``'s parameters and buffers by state_dict name (a ``WeightTarget``)."""

    def __init__(self, module: torch.nn.Module, engine_id: str = "module"):
        self.module = module
        self.engine_id = engine_id

    def _targets(self) -> dict[str, torch.Tensor]:
        return {**dict(self.module.named_parameters()), **dict(self.module.named_buffers())}

    def _load(self, named: list[tuple[str, torch.Tensor]]) -> WeightUpdateResult:
        targets = self._targets()
        for name, t in named:
            if name not in targets:
                return WeightUpdateResult(ok=False, message=f"unknown tensor {name!r}")
            if tuple(targets[name].shape) != tuple(t.shape):
                return WeightUpdateResult(ok=False, message=f"shape mismatch for {name!r}: "
                                          f"{tuple(t.shape)} vs {tuple(targets[name].shape)}")
        with torch.no_grad():
            for name, t in named:
                targets[name].copy_(t)
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        return WeightUpdateResult(ok=True, num_tensors=len(named), num_bytes=nbytes)

    def load_bucket(self, bucket: Bucket, *, digests: dict[str, str] | None = None, checksum: str = DEFAULT
                    ) -> WeightUpdateResult:
        """All-or-nothing by name and shape; with ``digests`` (the sender's, ``checksum``) the loaded tensors are
        then re-hashed against them, and a mismatch fails the load."""
        result = self._load(bucket.unpack())
        if result.ok and digests:
            ok, message = self.verify_weights(digests, checksum=checksum)
            if not ok:
                return WeightUpdateResult(ok=False, num_tensors=result.num_tensors, num_bytes=result.num_bytes,
                                          message=f"did not verify: {message}")
        return result

    def update_weights(self, named_tensors) -> WeightUpdateResult:
        return self._load(list(named_tensors))

    def update_weights_from_disk(self, path: str) -> WeightUpdateResult:
        files = sorted((Path(path) / "transformer").glob("*.safetensors"))
        if not files:
            return WeightUpdateResult(ok=False, message=f"no safetensors under {path}/transformer")
        named = [(n, t) for f in files for n, t in load_file(str(f)).items()]
        return self._load(named)

    def verify_weights(self, expected_digests: dict[str, str], *, checksum: str = DEFAULT) -> tuple[bool, str]:
        """Re-hash the named tensors with ``checksum`` (``megaflow.checksum``; a ``wsum:`` digest with
        ``device_digest``, where the tensor lives) and compare."""
        targets = self._targets()
        for name, digest in expected_digests.items():
            if name not in targets:
                return False, f"tensor {name!r} not held by {self.engine_id}"
            held = targets[name]
            if (device_digest(held) if digest.startswith(WSUM) else tensor_digest(held, checksum)) != digest:
                return False, f"tensor {name!r} differs from what was sent"
        return True, f"{len(expected_digests)} tensors match"

    def checksum(self) -> str:
        """``weights_checksum`` over the module's state_dict (parameters and persistent buffers)."""
        return weights_checksum(self.module.state_dict(keep_vars=True).items())
