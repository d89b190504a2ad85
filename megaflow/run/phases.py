"""The rollout and training phases of an engine host that also trains (``MegaflowConfig.phased``): free the
engines' accelerator memory while the trainer runs. Design notes: docs/design/run.md.
"""
from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

import psutil
import torch

from megaflow.rollout.engine import Sampler

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
    """Switches engines off the accelerator for training when ``enabled`` (a phased run on GPU), and the
    ``trainer``'s offloadable parts off it outside training (``train.offload``; None: off)."""

    def __init__(self, engines: Sequence[Sampler], *, enabled: bool, trainer=None):
        self.engines = engines
        self.enabled = enabled and torch.cuda.is_available()
        self.trainer = trainer
        self.metrics: dict[str, float] = {}
        self._resident = 0
        if enabled and not self.enabled:
            log.info("phases: no CUDA device; engines keep their memory during training (release is GPU-only)")

    @contextlib.contextmanager
    def training(self):
        before = memory_snapshot()
        t0 = time.perf_counter()
        if self.enabled:
            for e in self.engines:
                e.release()
        offload = {}
        if self.trainer is not None:
            offload["reload/seconds"] = self.trainer.reload()["seconds"]
        during = memory_snapshot()
        try:
            yield
        finally:
            if self.trainer is not None:
                moved = self.trainer.offload(["states"])
                offload.update({"offload/bytes": moved["bytes"], "offload/seconds": moved["seconds"]})
            if self.enabled:
                for e in self.engines:
                    e.resume()
            self.metrics = {"colocate/switch_seconds": time.perf_counter() - t0, **offload,
                            **{f"{k}_rollout": v for k, v in before.items()},
                            **{f"{k}_train": v for k, v in during.items()}}

    def synced(self) -> None:
        """The engines hold the trainer's weights (after a weight sync): the trainer's parts leave (all of
        ``train.offload``'s; the weights only from here), counted into this iteration's metrics."""
        if self.trainer is None or self._resident:
            return
        moved = self.trainer.offload()
        for key, value in (("offload/bytes", moved["bytes"]), ("offload/seconds", moved["seconds"])):
            self.metrics[key] = self.metrics.get(key, 0.0) + value

    @contextlib.contextmanager
    def resident(self):
        """The trainer whole on its device for the block, its parts offloaded again after."""
        if self.trainer is None:
            yield
            return
        self.trainer.reload()
        self._resident += 1
        try:
            yield
        finally:
            self._resident -= 1
            if not self._resident:
                self.trainer.offload()
