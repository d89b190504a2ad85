"""Where the rollout engines live: every rank computes the same :class:`Placement` from the launch environment
and ``[rollout]``, without communication. Design notes: docs/design/parallel.md.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

ENGINE_HOSTS = ("rank0", "node", "rank")
PLACEMENTS = ("colocated", "disaggregated")
DRIVER = 0


def engine_host_ranks(engine_hosts: str, world_size: int, local_world_size: int) -> tuple[int, ...]:
    """The global ranks that start engines, in rank order (ValueError for an unknown choice or a launch
    whose world is not whole nodes of ``local_world_size`` processes)."""
    if engine_hosts not in ENGINE_HOSTS:
        raise ValueError(f"rollout.engine_hosts = {engine_hosts!r}: expected one of {', '.join(ENGINE_HOSTS)}")
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(f"rollout.engine_hosts = {engine_hosts!r}: {world_size} process(es) are not whole nodes of "
                         f"{local_world_size} (LOCAL_WORLD_SIZE)")
    if engine_hosts == "rank0":
        return (DRIVER,)
    if engine_hosts == "node":
        return tuple(range(0, world_size, local_world_size))
    return tuple(range(world_size))


def trainer_count(placement: str, engine_ranks: int, world_size: int) -> int:
    """How many launched ranks train (ranks ``0 .. n-1``); ValueError for an impossible split."""
    if placement not in PLACEMENTS:
        raise ValueError(f"rollout.placement = {placement!r}: expected one of {', '.join(PLACEMENTS)}")
    if placement == "colocated":
        if engine_ranks:
            raise ValueError(f"rollout.engine_ranks = {engine_ranks} is read only with rollout.placement = "
                             "'disaggregated' (colocated: every rank trains; rollout.engine_hosts picks engine hosts)")
        return world_size
    if not 1 <= engine_ranks < world_size:
        raise ValueError(f"rollout.placement = 'disaggregated' with rollout.engine_ranks = {engine_ranks}: needs "
                         f"1 <= engine_ranks < the {world_size} launched process(es) (WORLD_SIZE); the rest train")
    return world_size - engine_ranks


def launch_layout(placement: str, engine_hosts: str, engine_ranks: int, world_size: int,
                  local_world_size: int) -> tuple[tuple[int, ...], int]:
    """(engine host ranks, trainer count) of a launch; ValueError for a layout that cannot be."""
    trainers = trainer_count(placement, engine_ranks, world_size)
    if placement == "disaggregated":
        if engine_hosts != "rank0":
            raise ValueError(f"rollout.engine_hosts = {engine_hosts!r} is read only with rollout.placement = "
                             "'colocated' (disaggregated: every engine-only rank hosts engines)")
        return tuple(range(trainers, world_size)), trainers
    return engine_host_ranks(engine_hosts, world_size, local_world_size), trainers


def layout_gpus(parallel, rollout) -> int:
    """The launch size a config is laid out for: ``parallel.gpus``, else one model replica (tp * pp * cp) plus
    the engine-only ranks of a disaggregated placement."""
    if parallel.gpus:
        return parallel.gpus
    engine_only = rollout.engine_ranks if rollout.placement == "disaggregated" else 0
    return parallel.tp * parallel.pp * parallel.cp + engine_only


@dataclass(frozen=True, kw_only=True)
class Placement:
    """This rank's view of the engine placement (the same hosts on every rank)."""

    rank: int
    world_size: int
    local_rank: int
    hosts: tuple[int, ...]
    """Global ranks that start engines, in rank order."""
    engines_per_host: int
    trainers: int | None = None
    """Launched ranks ``0 .. trainers-1`` train (megatron's world); None = every rank."""

    @property
    def num_trainers(self) -> int:
        return self.world_size if self.trainers is None else self.trainers

    @property
    def is_trainer(self) -> bool:
        return self.rank < self.num_trainers

    @property
    def engine_ranks(self) -> tuple[int, ...]:
        """Launched ranks that only sample (disaggregated placement), in rank order."""
        return tuple(range(self.num_trainers, self.world_size))

    @property
    def is_host(self) -> bool:
        return self.rank in self.hosts

    @property
    def is_driver(self) -> bool:
        return self.rank == DRIVER

    @property
    def num_engines(self) -> int:
        """Engines in the whole run."""
        return len(self.hosts) * self.engines_per_host

    def engine_ids(self, host: int | None = None) -> list[str]:
        """Global ids of the engines on ``host`` (a global rank; default this rank; [] for a non-host)."""
        host = self.rank if host is None else host
        if host not in self.hosts:
            return []
        first = self.hosts.index(host) * self.engines_per_host
        return [f"engine{first + i}" for i in range(self.engines_per_host)]

    @property
    def device_index(self) -> int:
        """The local device this rank's engines pin to (its local rank's GPU)."""
        return self.local_rank


def placement_from_env(engine_hosts: str, engines_per_host: int, env=None, *, placement: str = "colocated",
                       engine_ranks: int = 0) -> Placement:
    """The placement of this process, from torchrun's environment (no variables: a 1-process run)."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    hosts, trainers = launch_layout(placement, engine_hosts, engine_ranks, world, local_world)
    return Placement(rank=int(env.get("RANK", "0")), world_size=world, local_rank=int(env.get("LOCAL_RANK", "0")),
                     hosts=hosts, engines_per_host=engines_per_host, trainers=trainers)


def worker_visible_devices(device_index: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for workers pinned to local device ``device_index``: the entry at that index of
    this process's ``visible`` list when set (e.g. "4,5" and 1 -> "5"), else the index itself."""
    if not visible:
        return str(device_index)
    ids = [d.strip() for d in visible.split(",")]
    if not 0 <= device_index < len(ids):
        raise ValueError(f"engine device_index {device_index} is outside CUDA_VISIBLE_DEVICES={visible!r}")
    return ids[device_index]
