"""The LoRA sync path: only the adapters move, into SGLang's own LoRA update.

Design notes: docs/design/bridge.md.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch

from megaflow.bridge.base import SyncStream, SyncError, SyncReport, WeightTarget, WeightUpdateResult


def sync_stream(trainer) -> Iterator[tuple[str, torch.Tensor]]:
    """What a sync moves (collective over trainer ranks): the adapters of a LoRA trainer, else every weight
    under the engine's names."""
    if getattr(trainer, "lora", None) is not None:
        fuse = trainer.family.engine_tensors  # the engine's names of fused projections (ModelFamily.engine_tensors)
        return trainer.iter_full_adapters() if fuse is None else fuse(trainer.iter_full_adapters())
    from megaflow.bridge.convert import engine_named_params
    return engine_named_params(trainer)


@runtime_checkable
class LoRATarget(WeightTarget, Protocol):
    """A ``WeightTarget`` that also merges LoRA adapters into its base (the SGLang engine, the balancer)."""

    def update_lora(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, alpha: float, rank: int,
                    verify: bool = True) -> WeightUpdateResult:
        """Replace the adapters (PEFT names), merged as ``base + alpha / rank * B @ A``; ``verify``: every adapter
        tensor re-hashed against what was sent."""
        ...


class LoRABridge:
    """Pushes the adapters into every engine through SGLang's LoRA merge (see the module's design notes)."""

    mode = "lora"

    def __init__(self, engines: Sequence[LoRATarget], *, alpha: float, rank: int, verify: bool = True):
        if not engines:
            raise ValueError("LoRABridge needs at least one engine")
        self.engines, self.alpha, self.rank, self.verify = list(engines), float(alpha), int(rank), verify

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        stream = SyncStream(named_tensors, digest=False)
        named = list(stream)
        if not named:
            raise ValueError("LoRA sync got no adapter tensors")
        for engine in self.engines:
            result = engine.update_lora(named, alpha=self.alpha, rank=self.rank, verify=self.verify)
            if not result.ok:
                raise SyncError(f"LoRA update of engine {getattr(engine, 'engine_id', '?')} failed: {result.message}")
        report = stream.report(self.mode, num_buckets=1)
        report.verified = self.verify
        report.message = f"{len(named)} adapter tensors to {len(self.engines)} engine(s)"
        return report
