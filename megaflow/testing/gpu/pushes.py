"""Weight pushes timed by the GPU checks (``cuda_ipc``, ``engine_sync``, ``sd35m_loop_*``): the first push apart from
the steady ones, and the steady push's GB/s against a device-to-device copy of the same bytes.

Invariant: the first push carries one-time setup (CUDA IPC handles, allocator growth, lazy imports), so it is never
averaged into the steady figure. Torch is imported inside the functions (the driver imports checks without it).
"""
from __future__ import annotations

import statistics
import time


def copy_seconds(nbytes: int, device, repeats: int = 5) -> float:
    """Median seconds of one ``copy_`` of ``nbytes`` bytes between two buffers on ``device`` (synchronised)."""
    import torch

    src = torch.ones(max(int(nbytes), 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    dst.copy_(src)
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def push_record(seconds: list[float], nbytes: int, copy_s: float) -> dict:
    """``seconds``: every push's, in order (at least 2). The first push's seconds, the steady pushes' median, their
    GB/s, the copy's GB/s and steady push / copy."""
    if len(seconds) < 2:
        raise ValueError(f"need the first push and at least one steady push, got {len(seconds)}")
    steady = statistics.median(seconds[1:])
    gb = nbytes / 1e9
    return {"first_push_s": round(seconds[0], 4), "steady_push_s": round(steady, 4), "steady_pushes": len(seconds) - 1,
            "push_gb_per_s": round(gb / steady, 3) if steady > 0 else None,
            "copy_gb_per_s": round(gb / copy_s, 3) if copy_s > 0 else None,
            "push_over_copy": round(steady / copy_s, 2) if copy_s > 0 else None}
