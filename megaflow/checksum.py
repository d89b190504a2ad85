"""The one home of megaflow's checksums: the digest of a tensor, of a byte buffer and of a file, by algorithm name:
``xxh3`` (the default; xxHash's XXH3 128-bit, about memory speed, catches corruption but not a forgery) or
``sha256`` (``hashlib``, cryptographic, ~9x the cost of a memcpy). A tensor on a GPU is digested where it lives
(``device_digest``, prefixed ``wsum:``: two position-weighted sums of its 16-bit words modulo 2^31 - 1, torch ops on
the device, 16 bytes to the host), whatever the algorithm named, and a ``wsum:`` digest is checked by the same
function wherever the tensor compared lives (``digest_like``).

Invariant: a tensor's digest covers its dtype string, its shape tuple's repr and its raw bytes, in that order (the
recipe of SGLang's update-weights checker: the same ``sha256`` digests), and the bridge's hash on the trainer's side
and every engine's re-hash of what it holds are this one function (``tensor_digest``). Checkpoint manifests
(``megaflow.trainer.manifest``) use ``file_digest``; an in-process target's whole-model ``checksum()`` is
``weights_checksum``. On the ground floor: torch and xxhash only.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import xxhash

ALGORITHMS = ("xxh3", "sha256")
DEFAULT = "xxh3"
_CHUNK = 8 << 20


def hasher(algorithm: str):
    """A fresh incremental hasher (``update(bytes-like)``, ``hexdigest()``) of ``algorithm``."""
    if algorithm == "xxh3":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown checksum {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")


def raw_digest(dtype: torch.dtype, shape, raw, algorithm: str) -> str:
    """Digest of a tensor given as dtype, shape and ``raw`` (a contiguous byte buffer, hashed in place)."""
    h = hasher(algorithm)
    h.update(str(dtype).encode())
    h.update(repr(tuple(shape)).encode())
    h.update(raw)
    return h.hexdigest()


def tensor_digest(t: torch.Tensor, algorithm: str) -> str:
    """Digest of dtype string, shape tuple repr and raw bytes of ``t``: on a GPU ``device_digest`` (nothing copied to
    the host), else ``algorithm`` over its bytes."""
    if t.is_cuda:
        return device_digest(t)
    t = t.detach().contiguous()
    return raw_digest(t.dtype, t.shape, t.reshape(-1).view(torch.uint8).numpy(), algorithm)


def digest_like(t: torch.Tensor, expected: str, algorithm: str) -> str:
    """``t``'s digest in the kind of ``expected``: ``device_digest`` (on ``t``'s own device) for a ``wsum:`` digest,
    else ``algorithm`` over its bytes on the host."""
    if expected.startswith(WSUM):
        return device_digest(t)
    t = t.detach().to("cpu").contiguous()
    return raw_digest(t.dtype, t.shape, t.reshape(-1).view(torch.uint8).numpy(), algorithm)


WSUM = "wsum:"
_P = 2**31 - 1
_COL_RANGE = 2**21 - 1
"""Column weights lie in [1, 2^21 - 1]: a row's dot product (2^16 words below 2^15 in size) stays below 2^52, exact in
float64, so the sums run as one matrix product."""
_COLS = 1 << 16
_weights: dict[str, torch.Tensor] = {}


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of int64 ``x`` (values below 2^32; every product stays below 2^63)."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    return x ^ (x >> 16)


_SEEDS = ((0x243F6A88, 0x85A308D3), (0x13198A2E, 0x03707344))
"""(column, row) seeds of the two lanes."""


def _weights_of(index: torch.Tensor, kind: int, modulus: int) -> torch.Tensor:
    """[len(index), 2] pseudo-random weights in [1, modulus] of each index (``kind``: 0 columns, 1 rows)."""
    seeds = torch.tensor([s[kind] for s in _SEEDS], dtype=torch.int64, device=index.device)
    return _mix(index.unsqueeze(1) ^ seeds) % modulus + 1


def _column_weights(device: torch.device) -> torch.Tensor:
    key = str(device)
    if key not in _weights:
        index = torch.arange(_COLS, dtype=torch.int64, device=device)
        _weights[key] = _weights_of(index, 0, _COL_RANGE).to(torch.float64)
    return _weights[key]


def device_lanes(t: torch.Tensor) -> torch.Tensor:
    """int64 [2] on ``t``'s device: sum_i w_i * c_k(i mod 2^16) * s_k(i div 2^16) mod P (P = 2^31 - 1) over ``t``'s
    bytes read as signed 16-bit words w_i (an odd last byte is a word of its own), c_k in [1, 2^21 - 1], s_k in
    [1, P - 1]: any changed word (a flipped byte) changes each lane (P is prime and every factor is non-zero below
    it); moved or swapped bytes change it unless the pseudo-random weights cancel (about 1 in 2^62 for the two
    lanes). Each row of 2^16 words is one float64 dot product, exact below 2^53."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.data_ptr() % 2:
        raw = raw.clone()
    even = raw.numel() - raw.numel() % 2
    words = raw[:even].view(torch.int16)
    cols, rows, dev = _column_weights(raw.device), words.numel() // _COLS, raw.device
    block = 512 if raw.is_cuda else 32
    acc = torch.zeros(2, dtype=torch.int64, device=dev)
    for r0 in range(0, rows + 1, block):  # the last pass takes the rest, as a short row
        r1 = min(rows, r0 + block)
        full = words[r0 * _COLS:r1 * _COLS].view(r1 - r0, _COLS).to(torch.float64) @ cols
        rest = torch.cat([words[rows * _COLS:], raw[even:].to(torch.int16)]) if r1 == rows else words[:0]
        parts = torch.cat([full, rest.to(torch.float64).unsqueeze(0) @ cols[:rest.numel()]]) if rest.numel() else full
        index = torch.arange(r0, r0 + parts.shape[0], dtype=torch.int64, device=dev)
        acc += ((parts.to(torch.int64) % _P) * _weights_of(index, 1, _P - 1) % _P).sum(0)
        if r1 == rows:
            break
    return acc % _P


def lanes_digest(dtype: torch.dtype, shape, lanes) -> str:
    """The ``wsum:`` digest string of a tensor's dtype, shape and its two ``device_lanes`` (host ints)."""
    h = xxhash.xxh3_128()
    h.update(str(dtype).encode())
    h.update(repr(tuple(shape)).encode())
    h.update(b"".join(int(x).to_bytes(4, "little") for x in lanes))
    return WSUM + h.hexdigest()


def device_digest(t: torch.Tensor) -> str:
    """``t``'s ``wsum:`` digest: ``device_lanes`` on its device, 16 bytes to the host."""
    return lanes_digest(t.dtype, t.shape, device_lanes(t).tolist())


COPY_CHUNK = 1 << 20
"""Bytes ``copy_hashed`` copies, then hashes, at a time (within a core's L2 cache)."""


def copy_hashed(dst: torch.Tensor, src: torch.Tensor, algorithm: str) -> str:
    """Copy ``src`` into ``dst`` (a contiguous CPU tensor of the same shape and dtype) and return ``dst``'s
    ``tensor_digest``, hashing its bytes a chunk of rows at a time just after writing them (read back from cache)."""
    h = hasher(algorithm)
    h.update(str(dst.dtype).encode())
    h.update(repr(tuple(dst.shape)).encode())
    written = dst.detach().reshape(-1).view(torch.uint8).numpy()
    row_bytes = written.size // dst.shape[0] if dst.dim() and dst.shape[0] else 0
    with torch.no_grad():
        if written.size <= COPY_CHUNK or row_bytes == 0:
            dst.copy_(src)
            h.update(written)
            return h.hexdigest()
        step = max(1, COPY_CHUNK // row_bytes)
        for r in range(0, dst.shape[0], step):
            dst[r:r + step].copy_(src[r:r + step])
            h.update(written[r * row_bytes:(r + step) * row_bytes])
    return h.hexdigest()


def file_digest(path: Path | str, algorithm: str) -> str:
    """Digest of a file's bytes (read in chunks)."""
    h = hasher(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def weights_checksum(named_tensors) -> str:
    """SHA-256 hex over name, dtype, shape and raw bytes of every tensor, in name order: the whole-model checksum an
    in-process target reports (``bridge.target.ModuleTarget``, the diffusers baseline; SGLang has its own)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named_tensors, key=lambda kv: kv[0]):
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()
