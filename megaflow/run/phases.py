"""The rollout and training phases of an engine host (``bridge.mode = "colocated"``: the engines share the
trainer's GPU): free the engines' accelerator memory while the trainer runs.

``Phases.training()`` is a context manager: engines ``release()`` before, ``resume()`` after, and
process memory (RSS, and CUDA allocated when present) is logged before and after each switch. On a
CPU-only host the engines share host RAM with the trainer and SGLang's release path is GPU-only
(it calls torch.cuda.synchronize unconditionally), so the switch is skipped and only the
memory figures are logged -- stated once in the log, not silently. Metrics: ``colocate/switch_seconds``
and the memory figures ``mem/<name>_rollout`` / ``mem/<name>_train``.
"""
from __future__ import annotations

import contextlib
import logging
import time

import psutil
import torch

log = logging.getLogger("megaflow.run.phases")


def memory_snapshot() -> dict[str, float]:
    """Resident memory of this process and its children (engine workers), plus CUDA if present, in MiB."""
    proc = psutil.Process()
    rss = proc.memory_info().rss
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            rss += child.memory_info().rss
    out = {"mem/rss_mib": rss / 2**20}
    if torch.cuda.is_available():
        out["mem/cuda_alloc_mib"] = torch.cuda.memory_allocated() / 2**20
    return out


class Phases:
    """Switches engines off the accelerator for training when ``enabled`` (GPU colocated mode)."""

    def __init__(self, engines: list, *, enabled: bool):
        self.engines = engines
        self.enabled = enabled and torch.cuda.is_available()
        self.metrics: dict[str, float] = {}
        if enabled and not self.enabled:
            log.info("phases: no CUDA device; engines keep their memory during training (release is GPU-only)")

    @contextlib.contextmanager
    def training(self):
        before = memory_snapshot()
        t0 = time.perf_counter()
        if self.enabled:
            for e in self.engines:
                e.release()
        during = memory_snapshot()
        try:
            yield
        finally:
            if self.enabled:
                for e in self.engines:
                    e.resume()
            self.metrics = {"colocate/switch_seconds": time.perf_counter() - t0,
                            **{f"{k}_rollout": v for k, v in before.items()},
                            **{f"{k}_train": v for k, v in during.items()}}
