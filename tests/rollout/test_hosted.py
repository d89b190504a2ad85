"""Rollout and weight sync over several engine hosts (megaflow.rollout.hosted, megaflow.bridge.run_sync; the
placement itself: tests/parallel/test_placement.py).
Needs: CPU; the plan test 1 process (< 1 s); the exchange tests 4 gloo processes with fake engines (~15 s).

Reference: the same requests sampled and scored in ONE process on one fake engine (sample_and_score); every
rank of a 4-rank run with 2 hosts must hold bit-identical trajectory tensors, rewards and components in
request order. Syncs: every host's engines hold exactly the tensors sent; a host whose engine fails
verification makes every rank raise SyncError (none left waiting)."""
from __future__ import annotations

import pytest
import torch

import hosted_workers as hw
from megaflow.rollout.hosted import plan_groups, sample_and_score
from megaflow.rollout.types import RolloutRequest
from megaflow.testing.dist import run_multiprocess


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
@pytest.mark.parametrize("mode", ["shared_memory", "distributed"])
def test_hosted_rollout_and_sync_match_single_process(mode):
    trajs, scores, _ = _reference()
    env = {"LOCAL_WORLD_SIZE": "2"}  # 4 ranks as 2 nodes of 2 processes: hosts are ranks 0 and 2
    results = run_multiprocess(hw.hosted_rank, 4, "node", mode, env=env, timeout_s=120)
    sent = dict(hw.weights(3))  # the last push: only rank 2's engine fails verification
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
        if res["rank"] in (0, 2):  # the engine hosts hold the tensors sent ...
            held = res["engine_weights"]
            same = [torch.equal(held[n], sent[n]) for n in sent]
            assert held.keys() == sent.keys()
            if mode == "shared_memory" and res["rank"] == 2:  # ... but a shared-memory sync stops at the first
                assert same[0] and not all(same)  # bucket that does not verify: the later ones never reach it
            else:  # the distributed sync loads every bucket, then checks once
                assert all(same)
        else:
            assert res["engine_weights"] is None
