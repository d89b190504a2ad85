"""Which ranks train and which host engines (megaflow.parallel.placement), from the launch's environment.
Needs: CPU, 1 process, no torch (< 1 s)."""
from __future__ import annotations

import pytest

from megaflow.parallel.placement import (Placement, engine_host_ranks, launch_layout, placement_from_env,
                                         worker_visible_devices)


def test_engine_host_ranks():
    assert engine_host_ranks("rank0", 8, 4) == (0,)
    assert engine_host_ranks("node", 8, 4) == (0, 4)
    assert engine_host_ranks("node", 2, 1) == (0, 1)  # two 1-process nodes
    assert engine_host_ranks("node", 3, 3) == (0,)  # one node is fine
    assert engine_host_ranks("rank", 3, 3) == (0, 1, 2)
    with pytest.raises(ValueError, match="not whole nodes"):
        engine_host_ranks("node", 6, 4)
    with pytest.raises(ValueError, match="'gpu'"):
        engine_host_ranks("gpu", 2, 2)


def test_placement_ids_are_global_and_from_env():
    env = {"RANK": "4", "WORLD_SIZE": "8", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"}
    p = placement_from_env("node", 2, env=env)
    assert p.is_host and not p.is_driver and p.device_index == 0 and p.num_engines == 4
    assert p.engine_ids() == ["engine2", "engine3"] and p.engine_ids(0) == ["engine0", "engine1"]
    q = Placement(rank=5, world_size=8, local_rank=1, hosts=(0, 4), engines_per_host=2)
    assert not q.is_host and q.engine_ids() == []
    assert placement_from_env("rank0", 1, env={}).hosts == (0,)


def test_disaggregated_layout_puts_engines_on_the_last_ranks():
    # two nodes of 4: node 1 only samples; its ranks are the engine hosts, node 0 is megatron's world
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    p = placement_from_env("rank0", 2, env=env, placement="disaggregated", engine_ranks=4)
    assert p.hosts == (4, 5, 6, 7) and p.num_trainers == 4 and p.engine_ranks == (4, 5, 6, 7)
    assert p.is_host and not p.is_trainer and p.device_index == 1 and p.engine_ids() == ["engine2", "engine3"]
    d = placement_from_env("rank0", 2, env={**env, "RANK": "0", "LOCAL_RANK": "0"}, placement="disaggregated",
                           engine_ranks=4)
    assert d.is_driver and d.is_trainer and not d.is_host and d.engine_ids() == []
    c = placement_from_env("node", 1, env=env)  # colocated: every rank trains, no engine rank
    assert c.is_trainer and c.num_trainers == 8 and c.engine_ranks == ()
    assert launch_layout("disaggregated", "rank0", 1, 2, 1) == ((1,), 1)
    for engine_ranks, match in ((0, "needs 1 <= engine_ranks < the 2"), (2, "needs 1 <= engine_ranks < the 2")):
        with pytest.raises(ValueError, match=match):
            launch_layout("disaggregated", "rank0", engine_ranks, 2, 2)
    with pytest.raises(ValueError, match="engine_ranks = 1 is read only with rollout.placement = 'disaggregated'"):
        launch_layout("colocated", "rank0", 1, 2, 2)
    with pytest.raises(ValueError, match="engine_hosts = 'node' is read only with rollout.placement = 'colocated'"):
        launch_layout("disaggregated", "node", 1, 2, 2)
    with pytest.raises(ValueError, match="'remote'"):
        launch_layout("remote", "rank0", 0, 2, 2)


def test_engine_workers_see_only_their_device():
    assert worker_visible_devices(3, None) == "3" and worker_visible_devices(1, "") == "1"
    assert worker_visible_devices(1, "4, 5") == "5"  # an index into the launcher's visible list
    with pytest.raises(ValueError, match="device_index 2 is outside"):
        worker_visible_devices(2, "4,5")
