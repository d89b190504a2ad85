"""Rollout over every engine host: each rank calls ``HostedRollout.collect(requests)`` and gets the whole batch.
Design notes: docs/design/rollout.md.
"""
from __future__ import annotations

import random
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed

import torch

from megaflow.parallel.groups import as_group
from megaflow.parallel.placement import Placement
from megaflow.rollout.engine import Sampler
from megaflow.rollout.exchange import broadcast_share, pack_share, unpack_share
from megaflow.rollout.types import RewardScores, RolloutRequest, Trajectory
from megaflow.seeds import HOST_PLAN, iteration_seed


def plan_groups(requests: Sequence[RolloutRequest], hosts: Sequence[int], engines_per_host: int,
                seed: int) -> list[int]:
    """The host (global rank) of every request: group-atomic, fewest assigned samples per engine first,
    ties broken by ``random.Random(seed)``."""
    rng = random.Random(seed)
    load = {h: 0 for h in hosts}
    plan = []
    for r in requests:
        low = min(load.values())
        host = rng.choice([h for h in hosts if load[h] == low])
        load[host] += r.num_outputs / engines_per_host
        plan.append(host)
    return plan


def sample_and_score(rollout: Sampler, scorer, requests: Sequence[RolloutRequest]):
    """(trajectories in request order, RewardScores, timings): each group is scored as soon as it is back, while the
    others still sample; scores put back in request order."""
    t0 = time.perf_counter()
    pending = {future: g for g, future in enumerate(rollout.submit(requests))}
    groups: list = [None] * len(requests)
    scored: list = [None] * len(requests)
    for future in as_completed(pending):
        g = pending[future]
        groups[g] = future.result()
        images, prompts = torch.stack([t.image for t in groups[g]]), [t.prompt for t in groups[g]]
        metadata = [dict(requests[g].metadata) for _ in groups[g]] if requests[g].metadata else None
        scored[g] = scorer.submit(images, prompts, metadata)
    t_sampled = time.perf_counter()
    scores = RewardScores.concat([f.result() for f in scored])
    timings = {"time/sample_s": t_sampled - t0, "time/score_after_sample_s": time.perf_counter() - t_sampled}
    return [t for group in groups for t in group], scores, timings


class PendingCollect:
    """A collect in flight (:meth:`HostedRollout.start`); ``finish()`` once, on every rank."""

    def __init__(self, hosted: HostedRollout, requests: list[RolloutRequest], plan: list[int],
                 local: Future | None, t0: float):
        self.hosted, self.requests, self.plan, self.local, self.t0 = hosted, requests, plan, local, t0

    def finish(self) -> tuple[list[Trajectory], RewardScores, dict[str, float]]:
        """What :meth:`HostedRollout.collect` returns; ``time/collect_wait_s``: the seconds this rank waited for
        its own share (near 0 when the sampling ran while it trained)."""
        return self.hosted._exchange(self)


class HostedRollout:
    """This rank's part of the rollout: its engines (``local``: one engine or a Balancer; None on a rank
    that hosts none), its scorer, and the gloo ``group`` spanning every launched rank. On the driver of a
    disaggregated run, ``commands`` (megaflow.rollout.engine_commands.Commands) reach the engine ranks."""

    def __init__(self, placement: Placement, *, engines: Sequence[Sampler], local: Sampler | None, scorer, group,
                 seed: int, commands=None):
        if placement.is_host != bool(engines):
            raise ValueError(f"rank {placement.rank}: is_host={placement.is_host} but {len(engines)} engine(s)")
        self.placement, self.engines, self.local, self.scorer = placement, list(engines), local, scorer
        self.group, self.seed, self.commands = as_group(group), seed, commands
        self._background: ThreadPoolExecutor | None = None

    def release(self, interrupted: tuple | None = None) -> None:
        """The run is over, or ``interrupted`` (the Interrupted arguments: signal, iteration, checkpoint) and
        saved: the driver lets the engine ranks go (a no-op elsewhere). Only at a point where every rank
        has left its last collective."""
        if self.commands is not None:
            self.commands.send("stop", interrupted=interrupted)
            self.commands = None

    def collect(self, requests: Sequence[RolloutRequest],
                iteration: int) -> tuple[list[Trajectory], RewardScores, dict[str, float]]:
        """Every trajectory and reward of ``requests`` (request order) on every rank, plus timings and
        per-host counts (``rollout/host<rank>/images``, ``rollout/host<rank>/sample_s``)."""
        return self.start(requests, iteration).finish()

    def start(self, requests: Sequence[RolloutRequest], iteration: int) -> PendingCollect:
        """Begin :meth:`collect`: the engine ranks are told to sample, this host's engines sample and score its
        share in a background thread; ``finish()`` waits for them and exchanges the shares (the collective part:
        every rank calls it, in the same order as its other collectives on this group)."""
        p = self.placement
        t0 = time.perf_counter()
        if self.commands is not None:
            self.commands.send("collect", requests=list(requests), iteration=iteration)
        plan = plan_groups(requests, p.hosts, p.engines_per_host, iteration_seed(self.seed, iteration, HOST_PLAN))
        mine = [r for r, h in zip(requests, plan) if h == p.rank]
        local = None
        if mine:
            if self._background is None:
                self._background = ThreadPoolExecutor(1, thread_name_prefix="collect")
            local = self._background.submit(sample_and_score, self.local, self.scorer, mine)
        return PendingCollect(self, list(requests), plan, local, t0)

    def _exchange(self, pending: PendingCollect) -> tuple[list[Trajectory], RewardScores, dict[str, float]]:
        p, requests, plan = self.placement, pending.requests, pending.plan
        t_wait = time.perf_counter()
        share, timings = None, {}
        if pending.local is not None:
            trajs, scores, timings = pending.local.result()
            share = pack_share(trajs, scores, timings["time/sample_s"])
        t_wait = time.perf_counter() - t_wait
        all_trajs: list[Trajectory] = []
        all_scores: list[RewardScores] = []
        where: dict[str, int] = {}  # request id -> position of its first sample in all_trajs
        metrics: dict[str, float] = {}
        for host in p.hosts:
            theirs = [r for r, h in zip(requests, plan) if h == host]
            if not theirs:
                continue
            received = broadcast_share(share if host == p.rank else None, host, self.group)
            trajs, scores = unpack_share(received, theirs, host)
            metrics[f"rollout/host{host}/images"] = float(len(trajs))
            metrics[f"rollout/host{host}/sample_s"] = float(received["time.sample_s"][0])
            for r in theirs:
                where[r.request_id] = len(all_trajs)
                all_trajs.extend(trajs[:r.num_outputs])
                trajs = trajs[r.num_outputs:]
            all_scores.append(scores)
        order = [where[r.request_id] + j for r in requests for j in range(r.num_outputs)]
        merged = RewardScores.concat(all_scores)  # seconds: summed over hosts (scoring work, not wall time)
        scores = RewardScores(total=merged.total[order], components={k: v[order] for k, v in merged.components.items()},
                              weights=merged.weights, seconds=merged.seconds, info=merged.info,
                              timeouts=merged.timeouts)
        metrics.update({"time/sample_s": max(v for k, v in metrics.items() if k.endswith("/sample_s")),
                        "time/collect_s": time.perf_counter() - pending.t0, "time/collect_wait_s": t_wait,
                        "time/score_after_sample_s": timings.get("time/score_after_sample_s", 0.0)})
        return [all_trajs[i] for i in order], scores, metrics

    def metrics(self) -> dict:
        """The local balancer's per-engine counters (empty without one)."""
        return self.local.metrics() if self.local is not None and hasattr(self.local, "metrics") else {}

    def close(self) -> None:
        if self._background is not None:
            self._background.shutdown(wait=False, cancel_futures=True)
        for e in self.engines:
            e.shutdown()
        if self.scorer is not None:
            self.scorer.close()

