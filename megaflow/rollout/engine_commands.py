"""The driver's commands to the engine ranks of a disaggregated run, over the gloo ``control`` group: an engine
rank trains nothing, so the driver tells it what the trainer ranks are about to do. Design notes: docs/design/rollout.md.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from megaflow.parallel.placement import DRIVER
from megaflow.rollout.exchange import broadcast_share, pack_share, unpack_share
from megaflow.rollout.types import RolloutRequest, Trajectory

OPS = ("sync", "collect", "generate", "stop")


class Commands:
    """The control group's broadcast from the driver (its group rank 0): ``send`` there, ``receive`` elsewhere."""

    def __init__(self, group):
        self.group = group

    def send(self, op: str, **payload) -> None:
        if op not in OPS:
            raise ValueError(f"unknown engine-rank command {op!r}")
        self.group.broadcast_object((op, payload), DRIVER)

    def receive(self) -> tuple[str, dict]:
        return self.group.broadcast_object(None, DRIVER)


def _plan(requests: Sequence[RolloutRequest], hosts: Sequence[int]) -> list[int]:
    """The engine rank of each ``generate`` request: fewest samples first, ties by a fixed seed (the same plan
    on the driver and every engine rank)."""
    from megaflow.rollout.hosted import plan_groups
    return plan_groups(requests, hosts, 1, seed=0)


def exchange_generated(commands: Commands, hosts: Sequence[int], requests: Sequence[RolloutRequest], rank: int,
                       local=None) -> list[Trajectory]:
    """One ``generate``: every engine rank samples its share with ``local`` and broadcasts it on the control
    group; every member gets every trajectory in request order."""
    plan = _plan(requests, hosts)
    out: dict[int, list[Trajectory]] = {}
    for host in hosts:
        theirs = [i for i, h in enumerate(plan) if h == host]
        if not theirs:
            continue
        share = None
        if host == rank:
            t0 = time.perf_counter()
            trajs = local.generate([requests[i] for i in theirs])
            share = pack_share(trajs, None, time.perf_counter() - t0)
        trajs, _ = unpack_share(broadcast_share(share, host, commands.group), [requests[i] for i in theirs], host)
        for i in theirs:
            out[i], trajs = trajs[:requests[i].num_outputs], trajs[requests[i].num_outputs:]
    return [t for i in range(len(requests)) for t in out[i]]


class RemoteEngines:
    """The driver's engines when it hosts none: ``generate`` runs on the engine ranks."""

    def __init__(self, commands: Commands, hosts: Sequence[int]):
        self.commands, self.hosts = commands, tuple(hosts)

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        requests = list(requests)
        self.commands.send("generate", requests=requests)
        return exchange_generated(self.commands, self.hosts, requests, rank=0)
