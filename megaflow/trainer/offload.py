"""Trainer offload (``train.offload``): the trainer's accelerator memory moves to the host while the engines
sample, and comes back before it trains. Design notes: docs/design/trainer.md.
"""
from __future__ import annotations

import time
from collections.abc import Iterable

import torch

PARTS = {"none": (), "optimizer": ("states",), "all": ("states", "weights")}
MODES = tuple(PARTS)


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


class _HostCopies:
    """Device storages moved into reused host buffers and back, keyed by the storage itself (``_cdata``: stable
    while a storage is resized)."""

    def __init__(self):
        self.host: dict[int, torch.Tensor] = {}
        self.moved: dict[str, list[tuple[torch.UntypedStorage, int]]] = {}

    def offload(self, part: str, storages: list[torch.UntypedStorage]) -> int:
        moved = []
        for s in storages:
            n = s.nbytes()
            buf = self.host.get(s._cdata)
            if buf is None or buf.numel() != n:
                buf = self.host[s._cdata] = torch.empty(n, dtype=torch.uint8, pin_memory=s.device.type == "cuda")
            buf.copy_(_bytes_of(s), non_blocking=True)
            moved.append((s, n))
        _sync(any(s.device.type == "cuda" for s, _ in moved))  # the copies are done before the storage goes
        for s, _ in moved:
            s.resize_(0)
        self.moved[part] = moved
        return sum(n for _, n in moved)

    def reload(self, part: str) -> int:
        moved = self.moved.pop(part, [])
        for s, n in moved:
            s.resize_(n)
            _bytes_of(s).copy_(self.host[s._cdata], non_blocking=True)
        return sum(n for _, n in moved)


def _storages(tensors: Iterable[torch.Tensor], device: torch.device, skip: set[int]) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages of ``tensors`` on ``device``, except those in ``skip`` (by ``_cdata``)."""
    out: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        if t.device == device and s.nbytes() > 0 and s._cdata not in skip:
            out.setdefault(s._cdata, s)
    return list(out.values())


def inner_torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron optimizer (chained or not; [] for None)."""
    if optimizer is None:
        return []
    wrappers = getattr(optimizer, "chained_optimizers", [optimizer])
    return [w.optimizer for w in wrappers if getattr(w, "optimizer", None) is not None]


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor a megatron optimizer steps on or keeps: its inner torch optimizers' params and states."""
    out: list[torch.Tensor] = []
    for inner in inner_torch_optimizers(optimizer):
        out += [p for g in inner.param_groups for p in g["params"]]
        out += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


class TrainerOffload:
    """Moves a ``megaflow.trainer.runner.Trainer``'s parts for ``mode`` (one of :data:`MODES`) off its device and
    back. ``offload(parts)`` / ``reload()`` return ``{"bytes": moved, "seconds": taken}``."""

    def __init__(self, trainer, mode: str):
        if mode not in MODES:
            raise ValueError(f"train.offload = {mode!r}: one of {MODES}")
        self.trainer, self.mode, self.parts = trainer, mode, PARTS[mode]
        self.device = next(p for m in trainer.model for p in m.parameters()).device
        self.cuda = self.device.type == "cuda"
        self.offloaded: list[str] = []
        self._copies = _HostCopies()

    def _params(self) -> list[torch.Tensor]:
        return [p for m in self.trainer.model for p in m.parameters()]

    def offload(self, parts: Iterable[str] | None = None) -> dict[str, float]:
        """Move ``parts`` (default: the mode's) that are still on the device; returns bytes and seconds."""
        t0, moved = time.perf_counter(), 0
        for part in parts if parts is not None else self.parts:
            if part in self.offloaded:
                continue
            moved += self._offload_states() if part == "states" else self._offload_weights()
            self.offloaded.append(part)
        _sync(self.cuda)
        if self.cuda and moved:
            torch.cuda.empty_cache()  # the freed blocks go back to the device for the engines
        return {"bytes": float(moved), "seconds": time.perf_counter() - t0}

    def reload(self) -> dict[str, float]:
        """Bring back every part that is off (weights first: the states' views may lie in them)."""
        t0, moved = time.perf_counter(), 0
        for part in sorted(self.offloaded, key=("weights", "states").index):
            moved += self._copies.reload(part)
            if part == "states":
                moved += self._restore_grads()
        self.offloaded.clear()
        _sync(self.cuda)
        return {"bytes": float(moved), "seconds": time.perf_counter() - t0}

    def _offload_states(self) -> int:
        opt = self.trainer.optimizer
        if opt is not None:
            opt.zero_grad()
        grads = 0
        for m in self.trainer.model:
            m.zero_grad_buffer()
            grads += sum(b.grad_data.numel() * b.grad_data.element_size() for b in _grad_buffers(m))
            m.offload_grad_buffers(synchronize=self.cuda, empty_cache=False)
        skip = {p.untyped_storage()._cdata for p in self._params()}  # main params that ARE the weights stay
        return grads + self._copies.offload("states", _storages(optimizer_tensors(opt), self.device, skip))

    def _offload_weights(self) -> int:
        return self._copies.offload("weights", _storages(self._params(), self.device, set()))

    def _restore_grads(self) -> int:
        grads = 0
        for m in self.trainer.model:
            m.restore_grad_buffers(synchronize=self.cuda)
            grads += sum(b.grad_data.numel() * b.grad_data.element_size() for b in _grad_buffers(m))
        return grads


def _grad_buffers(ddp) -> list:
    return [b for b in ddp.buffers + ddp.expert_parallel_buffers
            if b.grad_data is not None and b.grad_data.untyped_storage().nbytes() > 0]
