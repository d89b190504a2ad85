"""Where the rollout engines live: decided once per run from the launch and ``rollout.engine_hosts``.

Every rank computes the same :class:`Placement` from the launcher's environment (torchrun's RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), so no communication is needed to agree on it:

* ``rank0``: global rank 0 hosts every engine (one host);
* ``node``: the local rank 0 of every node hosts engines (global ranks 0, L, 2L, ... with L processes
  per node, as torchrun numbers them);
* ``rank``: every rank hosts engines.

A host starts ``rollout.num_engines`` engines pinned to its own local device (the GPU of its local
rank; on CPU nothing is pinned). Every rank is a trainer rank; global rank 0 is the driver (run dir,
metrics, evaluation, the source of a distributed weight sync). Engine ids are global
(``engine<host index * num_engines + i>``), so logs of engines on different nodes never collide.
Standard library only: preflight uses it before heavy imports.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

ENGINE_HOSTS = ("rank0", "node", "rank")
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


@dataclass(frozen=True, kw_only=True)
class Placement:
    """This rank's view of the engine placement (the same hosts on every rank)."""

    rank: int
    world_size: int
    local_rank: int
    hosts: tuple[int, ...]
    """Global ranks that start engines, in rank order."""
    engines_per_host: int

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


def placement_from_env(engine_hosts: str, engines_per_host: int, env=None) -> Placement:
    """The placement of this process, from torchrun's environment (no variables: a 1-process run)."""
    env = os.environ if env is None else env
    world = int(env.get("WORLD_SIZE", "1"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    return Placement(rank=int(env.get("RANK", "0")), world_size=world, local_rank=int(env.get("LOCAL_RANK", "0")),
                     hosts=engine_host_ranks(engine_hosts, world, local_world), engines_per_host=engines_per_host)


def worker_visible_devices(device_index: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for workers pinned to local device ``device_index``: the entry at that index of
    this process's ``visible`` list when set (e.g. "4,5" and 1 -> "5"), else the index itself."""
    if not visible:
        return str(device_index)
    ids = [d.strip() for d in visible.split(",")]
    if not 0 <= device_index < len(ids):
        raise ValueError(f"engine device_index {device_index} is outside CUDA_VISIBLE_DEVICES={visible!r}")
    return ids[device_index]
