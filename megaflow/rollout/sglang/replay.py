"""What an ``SGLangEngine`` re-applies after its workers restart: the last disk source, the tensors pushed
since (views of staging slots, else host copies) and the last LoRA adapters. Details: docs/design/rollout.md.
"""
from __future__ import annotations

import torch

from megaflow.rollout.sglang.weights import flatten


class ReplayStore:
    """The engine's weights to re-apply after a restart."""

    def __init__(self):
        self.disk_source: str | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self._owned: set[str] = set()  # names whose tensor is this store's own copy (safe to copy into)
        self.lora: tuple[dict[str, torch.Tensor], float, int] | None = None
        self._copying: torch.cuda.Event | None = None  # the last device-to-host copy into the store, in flight

    def keep(self, views: dict[str, torch.Tensor], *, alias: bool) -> None:
        """Keep ``views`` (the tensors just loaded): as they are with ``alias`` (views of a staging slot), else
        copied into this store's own host tensors (from a GPU: pinned, copied asynchronously on the current stream,
        so a push does not wait for its host copy; ``apply`` waits for it)."""
        cuda = False
        for name, t in views.items():
            if alias:
                self.tensors[name] = t
                self._owned.discard(name)
                continue
            cuda = cuda or t.is_cuda
            kept = self.tensors.get(name)
            if not (name in self._owned and kept.shape == t.shape and kept.dtype == t.dtype):
                kept = self.tensors[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
                self._owned.add(name)
            kept.copy_(t, non_blocking=t.is_cuda)
        if cuda:
            self._copying = torch.cuda.Event()
            self._copying.record()

    def keep_lora(self, named: list[tuple[str, torch.Tensor]], alpha: float, rank: int) -> None:
        self.lora = (dict((n, t.clone()) for n, t in named), alpha, rank)

    def reset_to_disk(self, path: str) -> None:
        """The engine reloaded from ``path``: replay that, and no tensor pushed before it."""
        self.disk_source, self.tensors, self._owned = str(path), {}, set()

    def apply(self, server) -> list[tuple[bool, str]]:
        """Re-apply everything kept to a freshly started ``EngineServer``; one (ok, message) per step."""
        if self._copying is not None:
            self._copying.synchronize()
        results = []
        if self.disk_source is not None:
            results.append(server.update_from_disk(self.disk_source))
        if self.tensors:
            results.append(server.update_from_bucket(*flatten(list(self.tensors.items()))))
        if self.lora is not None:
            tensors, alpha, rank = self.lora
            results.append(server.update_lora_from_tensors(list(tensors.items()), alpha=alpha, rank=rank))
        return results
