"""``megaflow bench sync``'s phases: the trainer side's gather, convert, pack and digest, each timed alone over the
same tensors, beside a plain copy of their bytes. Design notes: docs/design/bench.md.

Invariant: every phase is timed in the same round as a plain copy of the same bytes (rounds rotate the order), so
a ratio compares two things that saw the same load on a shared machine.
"""
from __future__ import annotations

import statistics
import time

import torch

__all__ = ["Source", "phase_seconds", "time_rounds", "trainer_phases"]


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Source:
    """The trainer side of a bench: the DiT's full weights under megatron's names (what one trainer rank's
    ``iter_full_params`` yields), the family's weight map and config, and preallocated copy targets."""

    def __init__(self, engine_state: dict[str, torch.Tensor], diffusers_config: dict):
        from megaflow.models.sd3.config import from_diffusers
        from megaflow.models.sd3.weight_map import WEIGHTS

        self.config = from_diffusers(diffusers_config)
        self.weights = WEIGHTS
        self.megatron = WEIGHTS.to_megatron_full(engine_state, self.config)
        self.order = list(engine_state)
        self.nbytes = sum(t.numel() * t.element_size() for t in engine_state.values())
        self._dst = {n: torch.empty_like(t) for n, t in engine_state.items()}
        self.engine_state = engine_state
        self.copy()  # touch the targets once

    def gather(self):
        """One rank's stream of full tensors (a TP all-gather has nothing to gather on one process)."""
        return ((n, t.detach()) for n, t in self.megatron.items())

    def stream(self):
        """gather -> convert: the engine-named stream a sync pushes (``bridge.convert.engine_named_params``)."""
        return (p for n, t in self.gather() for p in self.weights.megatron_to_diffusers(n, t, self.config))

    def copy(self) -> None:
        """The reference: ``copy_`` of every engine-named tensor into a preallocated one of its shape."""
        for n, t in self.engine_state.items():
            self._dst[n].copy_(t)


def _cpu_seconds(processes) -> float:
    """CPU seconds (user + system, every thread) of this process and of ``processes`` (``psutil.Process``)."""
    return time.process_time() + sum(sum(p.cpu_times()[:2]) for p in processes)


def time_rounds(fns: dict, repeats: int, pids: list[int] = ()) -> dict[str, dict[str, float]]:
    """Per function of ``fns`` over ``repeats`` rounds (the order rotated each round): the median and fastest
    wall seconds (``median``, ``fastest``) and the median CPU seconds of this process and of ``pids``
    (and their children; ``cpu``: the work done, which a shared machine's load stretches less)."""
    import psutil

    processes = [q for pid in pids for p in [psutil.Process(pid)] for q in [p, *p.children(recursive=True)]]
    names, wall, cpu = list(fns), {n: [] for n in fns}, {n: [] for n in fns}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            c0 = _cpu_seconds(processes)
            wall[name].append(_seconds(fns[name]))
            cpu[name].append(_cpu_seconds(processes) - c0)
    return {"median": {n: statistics.median(v) for n, v in wall.items()},
            "fastest": {n: min(v) for n, v in wall.items()}, "cpu": {n: statistics.median(v) for n, v in cpu.items()}}


def trainer_phases(source: Source, *, bucket_bytes: int, checksum: str, slots=None) -> dict:
    """The trainer side's phases as timed functions (for ``time_rounds``, beside the pushes): copy, gather,
    gather + convert, pack, and pack while hashing (the sender's digest, as ``SharedMemoryBridge`` packs it), into
    ``slots`` (``StagingSlots``; default new ones)."""
    from megaflow.bridge.buckets import StagingSlots, iter_buckets

    slots = StagingSlots() if slots is None else slots
    streamed = list(source.stream())  # in the order a push packs them: the same buckets, the same slots

    def pack(hash_as_packed: str | None):
        for bucket in iter_buckets(streamed, bucket_bytes, staging=slots, checksum=hash_as_packed):
            bucket.digests(checksum) if hash_as_packed else None
    pack(None)
    return {"copy": source.copy, "gather": lambda: sum(1 for _ in source.gather()),
            "gather_convert": lambda: sum(1 for _ in source.stream()), "pack": lambda: pack(None),
            "pack_digest": lambda: pack(checksum)}


def phase_seconds(s: dict[str, float]) -> dict[str, float]:
    """Each phase's seconds from ``time_rounds``' medians of ``trainer_phases`` and the two pushes (``no_verify``,
    ``verify``): the push's is the unverified push less gather, convert and pack; verify's the verified push less
    the unverified one (the sender's digest and the engines' re-hash)."""
    def less(a: float, *b: float) -> float:
        return max(a - sum(b), 0.0)
    return {"copy": s["copy"], "gather": s["gather"], "convert": less(s["gather_convert"], s["gather"]),
            "pack": s["pack"], "digest": less(s["pack_digest"], s["pack"]),
            "push": less(s["no_verify"], s["gather_convert"], s["pack"]), "verify": less(s["verify"], s["no_verify"])}
