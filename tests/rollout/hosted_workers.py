"""Rank functions for tests/rollout/test_hosted.py: HostedRollout and RunSync over gloo with fake engines
(no SGLang): a trajectory's tensors are a function of its seed, a reward of its image, so every rank can be
compared with a single-process reference."""
from __future__ import annotations

import os
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist

from megaflow.bridge.base import SyncError
from megaflow.checksum import tensor_digest
from megaflow.rollout.types import RewardScores
from megaflow.bridge.base import WeightUpdateResult
from megaflow.rollout.types import RolloutRequest, Trajectory

STEPS = 3


def fake_trajectory(r: RolloutRequest, j: int, seed: int, engine_id: str) -> Trajectory:
    g = torch.Generator().manual_seed(seed)
    return Trajectory(request_id=r.request_id, index=j, prompt=r.prompt, seed=seed,
                      latents=torch.randn(STEPS + 1, 2, 4, 4, generator=g), sigmas=torch.linspace(1, 0, STEPS + 1),
                      log_probs=torch.randn(STEPS, generator=g), sde_mask=r.sde_mask(), sde_type=r.sde_type,
                      noise_level=r.noise_level, log_prob_no_const=r.log_prob_no_const,
                      guidance_scale=r.guidance_scale, do_cfg=r.do_cfg,
                      conditioning={"encoder_hidden_states": torch.randn(5, 8, generator=g).to(torch.bfloat16),
                                    "pooled_projections": torch.randn(6, generator=g)},
                      image=torch.rand(3, 8, 8, generator=g), engine_id=engine_id)


class FakeEngine:
    """Trajectories from seeds; weights as a dict of the tensors loaded from buckets."""

    def __init__(self, engine_id: str):
        self.engine_id, self.weights, self.corrupt = engine_id, {}, False

    def submit(self, requests):
        out = []
        for r in requests:
            f = Future()
            f.set_result([fake_trajectory(r, j, s, self.engine_id) for j, s in enumerate(r.output_seeds())])
            out.append(f)
        return out

    def load_bucket(self, bucket, *, digests=None, checksum="xxh3"):
        self.weights.update({n: t.clone() for n, t in bucket.unpack()})
        ok, message = self.verify_weights(digests, checksum=checksum) if digests else (True, "")
        return WeightUpdateResult(ok=ok, seconds=0.0, message=message)

    def verify_weights(self, expected, *, checksum="xxh3"):
        bad = [n for n, d in expected.items() if n not in self.weights or tensor_digest(self.weights[n], checksum) != d]
        bad += ["corrupt"] if self.corrupt else []
        return (not bad, f"mismatch {bad[:1]}" if bad else "")

    def shutdown(self):
        pass


class FakeScorer:
    """Two components: mean red, mean image; the total is their weighted sum."""

    def submit(self, images, prompts, metadata=None):
        f = Future()
        comps = {"red": images[:, 0].mean(dim=(1, 2)), "mean": images.mean(dim=(1, 2, 3))}
        f.set_result(RewardScores(total=comps["red"] + 0.5 * comps["mean"], components=comps,
                                  weights={"red": 1.0, "mean": 0.5}, seconds={"red": 0.0, "mean": 0.0}))
        return f

    def close(self):
        pass


def requests(n: int = 5, k: int = 3) -> list[RolloutRequest]:
    return [RolloutRequest(prompt=f"p{g}", num_outputs=k, seed=100 + 10 * g, num_steps=STEPS,
                           request_id=f"it1-g{g}") for g in range(n)]


def weights(step: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [(f"w{i}", torch.randn(17 + i, generator=g)) for i in range(6)] + [("b", torch.ones(3).to(torch.bfloat16))]


def hosted_rank(engine_hosts: str, mode: str):
    """Collect one batch and sync twice; returns what this rank saw (trajectories as tensors, scores,
    metrics, the tensors its engines hold)."""
    from megaflow.bridge.shared_memory import SharedMemoryBridge
    from megaflow.bridge.distributed import DistributedBridge, DistributedReceiver
    from megaflow.bridge.run_sync import RunSync
    from megaflow.parallel.placement import placement_from_env
    from megaflow.rollout.hosted import HostedRollout

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    p = placement_from_env(engine_hosts, 1)
    engines = [FakeEngine(i) for i in p.engine_ids()]
    group = dist.new_group(backend="gloo")
    hosted = HostedRollout(p, engines=engines, local=engines[0] if engines else None,
                           scorer=FakeScorer() if engines else None, group=group, seed=7)
    trajs, scores, metrics = hosted.collect(requests(), 1)
    if mode == "distributed":
        wgroup = dist.new_group(sorted({0, *p.hosts}), backend="gloo")
        if p.is_driver:
            sync = RunSync(p, group=group, bridge=DistributedBridge(group=wgroup, bucket_bytes=200, engines=engines))
        else:
            sync = RunSync(p, group=group, receiver=DistributedReceiver(engines, group=wgroup) if engines else None)
    else:
        sync = RunSync(p, group=group, bridge=SharedMemoryBridge(engines, bucket_bytes=200) if engines else None)
    syncs = [sync.push(iter(weights(s))).as_metrics() for s in (1, 2)]
    failed = ""
    if p.rank == p.hosts[-1]:
        engines[0].corrupt = True  # the last host's engine now fails verification
    try:
        sync.push(iter(weights(3)))  # every rank must raise, none may be left waiting
    except SyncError as e:
        failed = str(e)
    out = {"trajs": [(t.request_id, t.index, t.seed, t.latents, t.log_probs, t.sde_mask, t.conditioning, t.image)
                     for t in trajs],
           "total": scores.total, "components": scores.components, "metrics": metrics, "syncs": syncs,
           "engine_weights": engines[0].weights if engines else None, "failed": failed,
           "rank": int(os.environ["RANK"])}
    dist.destroy_process_group()
    return out
