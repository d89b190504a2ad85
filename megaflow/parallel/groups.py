"""The launch's rendezvous store, and the process groups megaflow builds on it beside megatron's.

Design notes: docs/design/parallel.md.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

_launch: dict = {}


def launch_store(timeout_s: float):
    """(store, rank, world size) of this launch, created once per process: torchrun's store from its
    environment (MASTER_ADDR/MASTER_PORT; the elastic agent's store when torchrun hosts one), or an in-memory
    store for a 1-process run without one (no port bound, nothing written to os.environ)."""
    if "store" not in _launch:
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1 and "MASTER_PORT" not in os.environ:
            raise ValueError(f"WORLD_SIZE={world} but MASTER_PORT is not set (launch with torchrun)")
        if world == 1 and "MASTER_PORT" not in os.environ:
            store = dist.HashStore()
        else:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=timeout_s)))
        _launch.update(store=store, rank=rank, world=world)
    return _launch["store"], _launch["rank"], _launch["world"]


def forget_launch() -> None:
    """Drop the cached store (after the default group is destroyed; the next launch_store makes a new one)."""
    _launch.clear()


@dataclass(frozen=True)
class Group:
    """A process group over ``ranks`` (launch ranks, ascending) and this rank's place in it."""

    pg: object
    ranks: tuple[int, ...]

    def rank_of(self, launch_rank: int) -> int:
        """The group rank of ``launch_rank``."""
        return self.ranks.index(launch_rank)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def broadcast_object(self, obj, src: int):
        """``obj`` of launch rank ``src`` (read there only) on every member (pickled)."""
        box = [obj]
        dist.broadcast_object_list(box, group=self.pg, group_src=self.rank_of(src))
        return box[0]


def new_group(name: str, ranks, *, timeout_s: float, backend: str = "gloo") -> Group | None:
    """A ``backend`` group over launch ``ranks`` named ``name`` (unique per launch), created by its members
    only (None on the others). Needs :func:`launch_store` to have run (init_distributed does)."""
    store, rank, _ = launch_store(timeout_s)
    ranks = tuple(sorted(set(ranks)))
    if rank not in ranks:
        return None
    prefixed = dist.PrefixStore(f"megaflow/{name}", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, ranks.index(rank), len(ranks), opts)
    elif backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, ranks.index(rank), len(ranks), timeout)
    else:
        raise ValueError(f"process group backend {backend!r}: expected gloo or nccl")
    return Group(pg, ranks)


def as_group(group) -> Group:
    """``group`` as a :class:`Group`: a Group as it is, None = the default group, or a registered process group
    (torch.distributed.new_group)."""
    if isinstance(group, Group):
        return group
    if group is None:
        return Group(dist.group.WORLD, tuple(range(dist.get_world_size())))
    return Group(group, tuple(dist.get_process_group_ranks(group)))


@dataclass(frozen=True)
class RunGroups:
    """The groups of one run (see the module's design notes); ``control`` and ``weights`` are None where this rank
    is not a member or the run needs none."""

    everyone: Group
    control: Group | None
    weights: Group | None


def run_groups(placement, *, weights: bool, timeout_s: float) -> RunGroups:
    """This rank's RunGroups for ``placement`` (megaflow.parallel.placement.Placement); ``weights``: bridge.mode =
    distributed (NCCL when CUDA is visible, else gloo). Every launched rank calls it."""
    import torch

    from megaflow.parallel.placement import DRIVER
    everyone = new_group("everyone", range(placement.world_size), timeout_s=timeout_s)
    control = (new_group("control", (DRIVER, *placement.engine_ranks), timeout_s=timeout_s)
               if placement.engine_ranks else None)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    wgroup = new_group("weights", (DRIVER, *placement.hosts), timeout_s=timeout_s, backend=backend) if weights else None
    return RunGroups(everyone, control, wgroup)
