"""Pack streamed named tensors into flat byte buckets, and per-tensor digests (on the host hashed as packed, each
chunk just after it is written, while it is in cache; on a GPU ``checksum.device_lanes`` on the device).

Design notes: docs/design/bridge.md.
"""
from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from megaflow.checksum import copy_hashed, device_lanes, lanes_digest, raw_digest

ALIGN = 16
"""Byte alignment of every tensor's start in a bucket (a uint8 slice viewed as fp32/fp64 needs it)."""


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
    slot: str | None = None
    """Set when ``flat`` is a :class:`StagingSlots` slot: a key naming that memory, which holds these tensors'
    latest pushed values until a later sync overwrites them in place (a layout change gets new memory under
    the same key). None: the memory may be reused for other tensors once the bucket is loaded."""
    hashed: tuple[str, dict[str, str]] | None = None
    """(checksum, digests by name) of the tensors as they were packed, when ``pack`` hashed them."""

    @property
    def num_bytes(self) -> int:
        return int(self.flat.numel())

    def unpack(self) -> list[tuple[str, torch.Tensor]]:
        """Reconstruct (name, tensor) pairs (views into ``flat``)."""
        return _views(self.flat, self.metadata)

    def digests(self, checksum: str) -> dict[str, str]:
        """The ``checksum`` digest (``megaflow.checksum``) of every tensor in the bucket, by name (read
        from the packed bytes: those ``pack`` hashed, else hashed now; a GPU bucket's on the device, one transfer
        of 16 bytes a tensor)."""
        if self.hashed is not None and self.hashed[0] == checksum:
            return dict(self.hashed[1])
        if self.flat.is_cuda:
            return self.device_digests()
        host = self.flat.numpy()
        return {m.name: raw_digest(m.dtype, m.shape, host[m.start_idx:m.end_idx], checksum) for m in self.metadata}


    def device_digests(self) -> dict[str, str]:
        """Every tensor's ``checksum.device_digest``, computed where ``flat`` lives; one transfer of 16 bytes a
        tensor to the host for the whole bucket."""
        lanes = torch.stack([device_lanes(t) for _, t in self.unpack()]).cpu().tolist()
        return {m.name: lanes_digest(m.dtype, m.shape, x) for m, x in zip(self.metadata, lanes)}


class StagingBuffer:
    """One CPU byte buffer (in shared memory with ``shared``) reused by every bucket packed into it: grown to
    the largest bucket, never shrunk. A bucket packed here is valid until the next one is packed: use one
    bucket at a time (``iter_buckets`` packs the next only when asked for it). CUDA buckets are not staged
    (the caching allocator already reuses device memory)."""

    def __init__(self, *, shared: bool):
        self.shared = shared
        self._flat: torch.Tensor | None = None

    def take(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the buffer (a view)."""
        if self._flat is None or self._flat.numel() < nbytes:
            self._flat = torch.empty(nbytes, dtype=torch.uint8)
            if self.shared:
                self._flat.share_memory_()
        return self._flat[:nbytes]


class StagingSlots:
    """Shared-memory buffers, one per bucket position in a sync: the bucket at position ``index`` is packed into
    buffer ``index`` as long as its layout (names, shapes, dtypes, offsets) equals that buffer's previous one,
    else into a new buffer (the old one stays alive for whoever still holds views of it).
    Extra memory: the full set of synced tensors (in place of a single bucket for ``StagingBuffer``)."""

    def __init__(self):
        self._token = uuid.uuid4().hex[:12]
        self._slots: dict[int, tuple[tuple, torch.Tensor]] = {}  # position -> (layout, flat)

    def take(self, index: int, meta: list[TensorMeta]) -> tuple[torch.Tensor, str]:
        """(flat, key) for the bucket at position ``index`` with metadata ``meta``; the key names the position
        (a new buffer at a position replaces the old one under the same key)."""
        layout = tuple((m.name, m.shape, m.dtype, m.start_idx, m.end_idx) for m in meta)
        kept = self._slots.get(index)
        if kept is None or kept[0] != layout:
            kept = self._slots[index] = (layout, torch.empty(meta[-1].end_idx, dtype=torch.uint8).share_memory_())
        return kept[1], f"{self._token}:{index}"


def _views(flat: torch.Tensor, metadata: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata]


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack(named_tensors: list[tuple[str, torch.Tensor]], *, shared: bool = False,
         staging: StagingBuffer | StagingSlots | None = None, index: int = 0, checksum: str | None = None) -> Bucket:
    """Pack a list of tensors into one bucket on the first tensor's device (each tensor copied once);
    ``shared``: a CPU bucket is allocated in shared memory; ``staging``: a CPU bucket goes into that buffer
    (its ``shared`` applies), or into slot ``index`` of ``StagingSlots``; ``checksum``: a CPU bucket's tensors are
    hashed as they are packed (``Bucket.hashed``)."""
    if not named_tensors:
        raise ValueError("cannot pack an empty bucket")
    meta, offset = [], 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        meta.append(TensorMeta(name=name, shape=tuple(t.shape), dtype=t.dtype, start_idx=offset,
                               end_idx=offset + nbytes, numel=nbytes))
        offset = _aligned(offset + nbytes)
    device, nbytes = named_tensors[0][1].device, meta[-1].end_idx
    slot = None
    if isinstance(staging, StagingSlots) and device.type == "cpu":
        flat, slot = staging.take(index, meta)
    elif staging is not None and device.type == "cpu":
        flat = staging.take(nbytes)
    else:
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if shared and device.type == "cpu":
            flat.share_memory_()
    hashed = {} if checksum is not None and device.type == "cpu" else None
    with torch.no_grad():
        for (_, t), (name, dst) in zip(named_tensors, _views(flat, meta)):
            if hashed is None:
                dst.copy_(t.detach())
            else:
                hashed[name] = copy_hashed(dst, t.detach(), checksum)
    return Bucket(flat=flat, metadata=meta, slot=slot, hashed=None if hashed is None else (checksum, hashed))


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, *, shared: bool = False,
                 staging: StagingBuffer | StagingSlots | None = None, checksum: str | None = None) -> Iterator[Bucket]:
    """Group a stream of tensors into buckets of at most ``bucket_bytes`` (a bigger tensor goes alone);
    ``shared`` / ``staging``: where CPU buckets go, ``checksum``: hashed as packed (see ``pack``)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    pending: list[tuple[str, torch.Tensor]] = []
    size = index = 0
    seen: set[str] = set()
    for name, t in named_tensors:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in one weight sync")
        seen.add(name)
        nbytes = _aligned(t.numel() * t.element_size())
        if pending and size + nbytes > bucket_bytes:
            yield pack(pending, shared=shared, staging=staging, index=index, checksum=checksum)
            pending, size, index = [], 0, index + 1
        pending.append((name, t))
        size += nbytes
    if pending:
        yield pack(pending, shared=shared, staging=staging, index=index, checksum=checksum)

