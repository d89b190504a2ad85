"""Data-parallel rollouts: N engines behind one ``RolloutEngine`` (a ``Sampler`` and a ``WeightTarget``, fanned out).
Design notes: docs/design/rollout.md."""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch

from megaflow.bridge.base import WeightUpdateResult
from megaflow.checksum import DEFAULT
from megaflow.rollout.engine import EngineHealth, RolloutEngine
from megaflow.rollout.types import RolloutRequest, Trajectory

__all__ = ["Balancer", "EngineStats"]


@dataclass(kw_only=True)
class EngineStats:
    """Counters of one engine behind the balancer."""

    engine_id: str
    num_requests: int = 0
    """Requests (groups) completed."""
    num_images: int = 0
    """Trajectories returned."""
    busy_seconds: float = 0.0
    """Wall time during which the engine had at least one request in flight."""
    in_flight: int = 0
    """Requests dispatched and not finished."""
    max_in_flight: int = 0
    """Peak of ``in_flight``."""
    num_errors: int = 0
    """Requests that raised."""


class Balancer:
    """Least-in-flight, group-atomic dispatch over engines (see the module's design notes)."""

    def __init__(self, engines: Sequence[RolloutEngine], *, seed: int = 0, max_in_flight_per_engine: int = 0,
                 engine_id: str = "balancer"):
        if not engines:
            raise ValueError("Balancer needs at least one engine, got none")
        ids = [e.engine_id for e in engines]
        if len(set(ids)) != len(ids):
            raise ValueError(f"engine ids must be unique, got {ids}")
        if max_in_flight_per_engine < 0:
            raise ValueError(f"max_in_flight_per_engine must be >= 0, got {max_in_flight_per_engine}")
        self.engine_id = engine_id
        self.engines = list(engines)
        self._cap = max_in_flight_per_engine
        self._rng = random.Random(seed)
        self._cond = threading.Condition()
        self._stats = [EngineStats(engine_id=i) for i in ids]
        self._busy_since: list[float | None] = [None] * len(ids)
        self._controlling = False
        self.assignments: list[tuple[str, str]] = []
        """(request_id, engine_id) of every dispatch, in dispatch order (a record for logs and tests)."""

    # ---------------------------------------------------------------- dispatch
    def _acquire(self, request: RolloutRequest, *, block: bool) -> int | None:
        """Pick the engine for ``request`` and count it in flight; None instead of waiting when not ``block`` and no slot is free."""
        with self._cond:
            while True:
                if not self._controlling:
                    loads = [s.in_flight for s in self._stats]
                    low = min(loads)
                    if not self._cap or low < self._cap:
                        break
                if not block:
                    return None
                self._cond.wait()
            idx = self._rng.choice([i for i, n in enumerate(loads) if n == low])
            s = self._stats[idx]
            if s.in_flight == 0:
                self._busy_since[idx] = time.perf_counter()
            s.in_flight += 1
            s.max_in_flight = max(s.max_in_flight, s.in_flight)
            self.assignments.append((request.request_id, s.engine_id))
            return idx

    def _release(self, idx: int, requests: list[RolloutRequest], num_images: int, failed: bool) -> None:
        with self._cond:
            s = self._stats[idx]
            s.in_flight -= len(requests)
            s.num_requests += len(requests)
            s.num_images += num_images
            s.num_errors += len(requests) if failed else 0
            if s.in_flight == 0:
                s.busy_seconds += time.perf_counter() - self._busy_since[idx]
                self._busy_since[idx] = None
            self._cond.notify_all()

    def _run(self, idx: int, requests: list[RolloutRequest], futures: list[Future]) -> None:
        """One engine call for the requests assigned to engine ``idx``; one future per request."""
        try:
            trajs = self.engines[idx].generate(requests)
            assert len(trajs) == sum(r.num_outputs for r in requests), (len(trajs), len(requests))
        except BaseException as exc:  # noqa: BLE001 - handed to the callers through the futures
            self._release(idx, requests, 0, failed=True)
            for f in futures:
                f.set_exception(exc)
            return
        self._release(idx, requests, len(trajs), failed=False)
        start = 0
        for r, f in zip(requests, futures):
            f.set_result(trajs[start:start + r.num_outputs])
            start += r.num_outputs

    def _launch(self, pending: dict[int, list[tuple[RolloutRequest, Future]]]) -> None:
        """Start one thread per engine with everything assigned to it (so the engine can batch it)."""
        for idx, items in pending.items():
            threading.Thread(target=self._run, args=(idx, [r for r, _ in items], [f for _, f in items]),
                             daemon=True, name=f"rollout-{self._stats[idx].engine_id}").start()
        pending.clear()

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        """Dispatch every request (``submit``) and return all trajectories in request order. If any request
        fails, the first error is raised after every dispatched request has finished."""
        futures = self.submit(requests)
        errors = [f.exception() for f in futures]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return [t for f in futures for t in f.result()]

    def submit(self, requests: Sequence[RolloutRequest]) -> list[Future]:
        """Dispatch every request (group-atomic, least in-flight engine each); one future per request. Requests of one
        call on the same engine go in ONE ``engine.generate``; returns once all are dispatched. Thread-safe."""
        futures: list[Future] = []
        pending: dict[int, list[tuple[RolloutRequest, Future]]] = {}
        for request in requests:
            idx = self._acquire(request, block=False)
            if idx is None:
                self._launch(pending)
                idx = self._acquire(request, block=True)
            fut: Future = Future()
            pending.setdefault(idx, []).append((request, fut))
            futures.append(fut)
        self._launch(pending)
        return futures

    # ---------------------------------------------------------------- metrics
    def metrics(self) -> dict:
        """Per-engine counters plus totals, JSON-able (busy time includes the running interval)."""
        now = time.perf_counter()
        with self._cond:
            engines = {}
            for s, since in zip(self._stats, self._busy_since):
                row = asdict(s)
                row["busy_seconds"] += (now - since) if since is not None else 0.0
                engines[s.engine_id] = row
        return {"engines": engines,
                "num_requests": sum(r["num_requests"] for r in engines.values()),
                "num_images": sum(r["num_images"] for r in engines.values()),
                "in_flight": sum(r["in_flight"] for r in engines.values())}

    def in_flight(self) -> list[int]:
        """Requests in flight per engine, in engine order."""
        with self._cond:
            return [s.in_flight for s in self._stats]

    # ---------------------------------------------------------------- control fan-out
    def _fan_out(self, fn: Callable[[RolloutEngine], object]) -> list:
        """Run ``fn(engine)`` on every engine once nothing is in flight; results in engine order, first error raised after all ran."""
        with self._cond:
            while self._controlling or any(s.in_flight for s in self._stats):
                self._cond.wait()
            self._controlling = True
        try:
            with ThreadPoolExecutor(max_workers=len(self.engines), thread_name_prefix="balancer-ctl") as pool:
                futures = [pool.submit(fn, e) for e in self.engines]
            errors = [f.exception() for f in futures]
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise first
            return [f.result() for f in futures]
        finally:
            with self._cond:
                self._controlling = False
                self._cond.notify_all()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightUpdateResult:
        """Send the same tensors to every engine; ok only if every engine reports ok."""
        items = list(named_tensors)  # an iterator can be consumed once; every engine needs all of it
        t0 = time.perf_counter()
        return self._merge(self._fan_out(lambda e: e.update_weights(items)), time.perf_counter() - t0)

    def load_bucket(self, bucket, *, digests: dict[str, str] | None = None, checksum: str = DEFAULT
                    ) -> WeightUpdateResult:
        """Hand the same bridge bucket (and ``digests`` to check it against) to every engine (each adapter
        serializes its own send)."""
        t0 = time.perf_counter()
        return self._merge(self._fan_out(lambda e: e.load_bucket(bucket, digests=digests, checksum=checksum)),
                           time.perf_counter() - t0)

    def update_lora(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, alpha: float, rank: int,
                    verify: bool = True) -> WeightUpdateResult:
        """Set the same LoRA adapters on every engine (megaflow.bridge.lora); ok only if every engine reports ok."""
        items = list(named_tensors)
        t0 = time.perf_counter()
        return self._merge(self._fan_out(lambda e: e.update_lora(items, alpha=alpha, rank=rank, verify=verify)),
                           time.perf_counter() - t0)

    def verify_weights(self, expected_digests: dict[str, str], *, checksum: str = DEFAULT) -> tuple[bool, str]:
        """Every engine re-hashes the named tensors (``checksum``); ok only if all match (message names the failures)."""
        results = self._fan_out(lambda e: e.verify_weights(expected_digests, checksum=checksum))
        failed = [f"{e.engine_id}: {msg}" for e, (ok, msg) in zip(self.engines, results) if not ok]
        if failed:
            return False, "; ".join(failed)
        return True, f"{len(expected_digests)} tensors match on {len(self.engines)} engines"

    def update_weights_from_disk(self, path: str) -> WeightUpdateResult:
        t0 = time.perf_counter()
        return self._merge(self._fan_out(lambda e: e.update_weights_from_disk(path)), time.perf_counter() - t0)

    def _merge(self, results: list[WeightUpdateResult], seconds: float) -> WeightUpdateResult:
        """One result for all engines: bytes summed over engines, wall seconds of the fan-out."""
        failed = [f"{e.engine_id}: {r.message or 'not ok'}" for e, r in zip(self.engines, results) if not r.ok]
        return WeightUpdateResult(ok=not failed, num_tensors=max(r.num_tensors for r in results),
                                  num_bytes=sum(r.num_bytes for r in results), seconds=seconds,
                                  message="; ".join(failed))

    def checksum(self) -> str:
        """The engines' common checksum; raises RuntimeError when any two engines differ."""
        sums = self._fan_out(lambda e: e.checksum())
        if len(set(sums)) != 1:
            detail = ", ".join(f"{e.engine_id}={s[:12]}" for e, s in zip(self.engines, sums))
            raise RuntimeError(f"engine weights disagree: {detail}")
        return sums[0]

    def release(self) -> None:
        self._fan_out(lambda e: e.release())

    def resume(self) -> None:
        self._fan_out(lambda e: e.resume())

    def health(self) -> EngineHealth:
        """Alive only if every engine is; restarts and worker pids summed/concatenated."""
        reports = [e.health() for e in self.engines]
        return EngineHealth(alive=all(h.alive for h in reports), engine_id=self.engine_id,
                            num_restarts=sum(h.num_restarts for h in reports),
                            worker_pids=[p for h in reports for p in h.worker_pids],
                            detail="; ".join(f"{h.engine_id or e.engine_id}: {'alive' if h.alive else 'DOWN'}"
                                             f"{' ' + h.detail if h.detail else ''}"
                                             for e, h in zip(self.engines, reports)))

    def shutdown(self) -> None:
        """Shut down every engine (idempotent); in-flight requests are not waited for."""
        errors = []
        for e in self.engines:
            try:
                e.shutdown()
            except Exception as exc:  # noqa: BLE001 - shut the rest down first, then report
                errors.append(exc)
        if errors:
            raise errors[0]
