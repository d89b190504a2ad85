"""Weight sync to every engine host: every rank calls ``RunSync.push(engine_named_params(trainer))`` (collective).
Design notes: docs/design/bridge.md.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from megaflow.bridge.base import SyncError, SyncReport
from megaflow.parallel.groups import as_group
from megaflow.parallel.placement import Placement


def _drain(stream: Iterable) -> None:
    for _ in stream:
        pass


class RunSync:
    """This rank's side of every sync: ``bridge`` (a WeightBridge pushing from this rank), ``receiver`` (a
    DistributedReceiver) or neither (the rank only takes part in the gather)."""

    def __init__(self, placement: Placement, *, group, bridge=None, receiver=None, commands=None):
        if bridge is not None and receiver is not None:
            raise ValueError("a rank either pushes or receives weights, not both")
        self.placement, self.group, self.bridge, self.receiver = placement, as_group(group), bridge, receiver
        self.commands = commands  # the driver's channel to engine ranks (megaflow.rollout.engine_commands)

    def _local(self, named_tensors: Iterable) -> tuple[bool, str, float, float, bool]:
        """(ok, message, bytes, tensors, verified) of this rank's part."""
        if self.receiver is not None:
            with ThreadPoolExecutor(1, thread_name_prefix="weights-receive") as pool:
                received = pool.submit(self.receiver.receive)
                _drain(named_tensors)
                ok, msg = received.result()
            return ok, msg, 0.0, 0.0, ok
        if self.bridge is None:
            _drain(named_tensors)
            return True, "", 0.0, 0.0, False
        try:
            report = self.bridge.push(named_tensors)
        except SyncError as e:
            return False, str(e), 0.0, 0.0, False
        return True, report.message, float(report.num_bytes), float(report.num_tensors), report.verified

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Sync every engine host; the report merged over them (the same on every rank; ``mode`` "run"): the
        slowest host's seconds, the driver's bytes and tensors, verified when every host verified. SyncError on
        every rank if a host's engines rejected or did not verify the weights."""
        t0 = time.perf_counter()
        if self.commands is not None:
            self.commands.send("sync")
        ok, msg, nbytes, ntensors, verified = self._local(named_tensors)
        p = self.placement
        row = torch.tensor([float(p.is_host), float(ok), time.perf_counter() - t0, nbytes, ntensors,
                            float(verified)], dtype=torch.float64)
        rows = [torch.empty_like(row) for _ in range(self.group.size)]
        dist.all_gather(rows, row, group=self.group.pg)
        table = torch.stack(rows)
        failed = [r for r in range(len(rows)) if not table[r, 1]]
        if failed:
            raise SyncError(f"weight sync failed on rank(s) {failed}" + (f": {msg}" if not ok else ""))
        hosts = table[table[:, 0] > 0]
        driver = table[0]
        return SyncReport(mode="run", num_tensors=int(driver[4]), num_bytes=int(driver[3]),
                          seconds=float(hosts[:, 2].max()), verified=bool(hosts[:, 5].all()),
                          hosts=int(hosts.shape[0]), hosts_verified=int(hosts[:, 5].sum()))
