"""Rollout and weight sync over several engine hosts (megaflow.parallel.placement, rollout.hosted, bridge.placed).
Needs: CPU; the plan tests 1 process (< 1 s); the exchange tests 4 gloo processes with fake engines (~15 s).

Reference: the same requests sampled and scored in ONE process on one fake engine (sample_and_score); every
rank of a 4-rank run with 2 hosts must hold bit-identical trajectory tensors, rewards and components in
request order. Syncs: every host's engines hold exactly the tensors sent; a host whose engine fails
verification makes every rank raise SyncError (none left waiting)."""
from __future__ import annotations

import pytest
import torch

import hosted_workers as hw
from megaflow.parallel.placement import (Placement, engine_host_ranks, launch_layout, placement_from_env,
                                worker_visible_devices)
from megaflow.rollout.hosted import plan_groups, sample_and_score
from megaflow.rollout.types import RolloutRequest
from megaflow.testing.dist import run_multiprocess


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


def test_plan_groups_is_group_atomic_balanced_and_seeded():
    reqs = [RolloutRequest(prompt="p", num_outputs=4, request_id=f"g{g}") for g in range(8)]
    plan = plan_groups(reqs, (0, 4), 1, seed=3)
    assert sorted(plan.count(h) for h in (0, 4)) == [4, 4]  # equal groups -> equal shares
    assert plan == plan_groups(reqs, (0, 4), 1, seed=3)
    assert len({tuple(plan_groups(reqs, (0, 4), 1, seed=s)) for s in range(6)}) > 1  # ties depend on the seed
    uneven = [RolloutRequest(prompt="p", num_outputs=k, request_id=str(i)) for i, k in enumerate([8, 2, 2, 2, 2])]
    plan = plan_groups(uneven, (0, 1), 1, seed=0)
    # the big group's host gets nothing until the other one has caught up
    assert plan[1:] == [plan[1]] * 4 and plan[1] != plan[0]


def _reference():
    engine = hw.FakeEngine("ref")
    return sample_and_score(engine, hw.FakeScorer(), hw.requests())


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.parametrize("mode", ["colocated", "distributed"])
def test_hosted_rollout_and_sync_match_single_process(mode):
    trajs, scores, _ = _reference()
    env = {"LOCAL_WORLD_SIZE": "2"}  # 4 ranks as 2 nodes of 2 processes: hosts are ranks 0 and 2
    results = run_multiprocess(hw.hosted_rank, 4, "node", mode, env=env, timeout_s=120)
    sent = dict(hw.weights(3))  # the last push reached every engine; only rank 2's verification failed
    for res in results:
        assert len(res["trajs"]) == len(trajs)
        for got, want in zip(res["trajs"], trajs):
            rid, index, seed, latents, log_probs, mask, cond, image = got
            assert (rid, index, seed) == (want.request_id, want.index, want.seed)
            assert torch.equal(latents, want.latents) and torch.equal(log_probs, want.log_probs)
            assert torch.equal(mask, want.sde_mask) and torch.equal(image, want.image)
            assert cond.keys() == want.conditioning.keys()
            assert all(torch.equal(cond[k], want.conditioning[k]) and cond[k].dtype == want.conditioning[k].dtype
                       for k in cond)
        assert torch.equal(res["total"], scores.total)
        assert all(torch.equal(res["components"][k], scores.components[k]) for k in scores.components)
        m = res["metrics"]
        assert m["rollout/host0/images"] + m["rollout/host2/images"] == len(trajs) and "rollout/host1/images" not in m
        assert m["rollout/host0/images"] > 0 and m["rollout/host2/images"] > 0
        for sync in res["syncs"]:
            assert sync["sync/verified"] == 1.0 and sync["sync/hosts"] == 2 and sync["sync/hosts_verified"] == 2
        assert res["syncs"] == results[0]["syncs"]  # merged: the same metrics on every rank
        assert "weight sync failed on rank(s) [" in res["failed"] and "2]" in res["failed"]  # the distributed
        # source reports its receivers' failure too: [0, 2]
        if res["rank"] in (0, 2):  # the engine hosts hold exactly the tensors sent
            held = res["engine_weights"]
            assert held.keys() == sent.keys() and all(torch.equal(held[n], sent[n]) for n in held)
        else:
            assert res["engine_weights"] is None
