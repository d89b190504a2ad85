"""The one home of megaflow's checksums: the digest of a tensor, of a byte buffer and of a file, by algorithm name:
``xxh3`` (the default; xxHash's XXH3 128-bit, about memory speed, catches corruption but not a forgery) or
``sha256`` (``hashlib``, cryptographic, ~9x the cost of a memcpy).

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
    """Digest of dtype string, shape tuple repr and raw bytes of ``t`` (copied to host only if it is not there)."""
    t = t.detach().to("cpu").contiguous()
    return raw_digest(t.dtype, t.shape, t.reshape(-1).view(torch.uint8).numpy(), algorithm)


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
