"""Pack streamed named tensors into flat byte buckets, and per-tensor SHA-256 digests.

A bucket is one contiguous ``uint8`` tensor holding several tensors back to back plus a list of
:class:`TensorMeta` (name, shape, dtype, byte range). This is the layout SGLang's
``load_format="flattened_bucket"`` reconstructs (bytes viewed back as dtype and reshaped), so one
bucket is one engine request and mixed dtypes are fine. ``iter_buckets`` consumes a generator and
never holds more than ~``bucket_bytes`` (plus one tensor larger than that, which gets a bucket of its
own) -- the trainer's full parameters are streamed, not materialised at once.

``tensor_sha256`` hashes dtype, shape and raw bytes, the same recipe as the engine's
update-weights checker, so expected digests computed here can be verified engine-side.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives inside a bucket (attribute names match the engine's metadata)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int  # number of BYTES in the bucket (the bucket is uint8)


@dataclass
class Bucket:
    """A flat uint8 tensor and the metadata to cut it back into named tensors."""

    flat: torch.Tensor
    metadata: list[TensorMeta]

    @property
    def num_bytes(self) -> int:
        return int(self.flat.numel())

    def unpack(self) -> list[tuple[str, torch.Tensor]]:
        """Reconstruct (name, tensor) pairs (views into ``flat``)."""
        out = []
        for m in self.metadata:
            chunk = self.flat[m.start_idx:m.end_idx]
            out.append((m.name, chunk.view(m.dtype).reshape(m.shape)))
        return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


def pack(named_tensors: list[tuple[str, torch.Tensor]]) -> Bucket:
    """Pack a list of tensors into one bucket (copies once)."""
    if not named_tensors:
        raise ValueError("cannot pack an empty bucket")
    parts, meta, offset = [], [], 0
    for name, t in named_tensors:
        b = _as_bytes(t)
        meta.append(TensorMeta(name=name, shape=tuple(t.shape), dtype=t.dtype,
                               start_idx=offset, end_idx=offset + b.numel(), numel=b.numel()))
        parts.append(b)
        offset += b.numel()
    return Bucket(flat=torch.cat(parts), metadata=meta)


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[Bucket]:
    """Group a stream of tensors into buckets of at most ``bucket_bytes`` (a bigger tensor goes alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    seen: set[str] = set()
    for name, t in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in one weight sync")
        seen.add(name)
        nbytes = t.numel() * t.element_size()
        if pending and size + nbytes > bucket_bytes:
            yield pack(pending)
            pending, size = [], 0
        pending.append((name, t))
        size += nbytes
    if pending:
        yield pack(pending)


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 over dtype string, shape tuple repr and the raw bytes (the engine checker's recipe)."""
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256()
    h.update(str(t.dtype).encode())
    h.update(repr(tuple(t.shape)).encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

