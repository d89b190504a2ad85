"""Host-memory measurements for CPU checks of activation recompute and of ``megaflow plan``.
Design notes: docs/design/testing.md.
"""
from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter (malloc.h)


def malloc_returns_memory(threshold_bytes: int = 64 * 1024) -> bool:
    """Fix glibc's mmap threshold at ``threshold_bytes`` (no dynamic raise): allocations at least that
    large get their own mapping and go back to the OS when freed. False where glibc is not found."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)))


def _status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def rss_bytes() -> int:
    """Resident memory of this process now (VmRSS)."""
    return _status_kb("VmRSS") * 1024


def peak_rss(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``(fn(), peak RSS while it ran minus RSS before it)`` in bytes (Linux only)."""
    Path("/proc/self/clear_refs").write_text("5")
    before = rss_bytes()
    result = fn()
    return result, _status_kb("VmHWM") * 1024 - before


def saved_tensor_bytes(forward: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> tuple[Any, int]:
    """``(forward(), bytes of the distinct storages autograd saved for backward during it)``, leaving out the
    storages of ``exclude`` (pass the model's parameters: a saved weight or a view of it is no activation)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = forward()
    return result, sum(storages.values())


def model_bytes(model: list[torch.nn.Module]) -> dict[str, int]:
    """Bytes a rank's model chunks hold, each storage counted once: ``params``, module ``buffers``
    (non-parameter tensors) and ``grad_buffers``: the contiguous grad (and separate param) buffers of
    every chunk wrapped in megatron's DistributedDataParallel (0 for unwrapped chunks)."""
    from megatron.core.distributed import DistributedDataParallel

    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for t in tensors:
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        return total

    ddp = [m for m in model if isinstance(m, DistributedDataParallel)]
    inner = [m.module if isinstance(m, DistributedDataParallel) else m for m in model]
    grad = [t for m in ddp for buf in m.buffers + m.expert_parallel_buffers
            for t in (buf.grad_data, buf.param_data) if t is not None]
    return {"params": size(p for m in inner for p in m.parameters()),
            "buffers": size(b for m in inner for b in m.buffers()),
            "grad_buffers": size(grad)}
