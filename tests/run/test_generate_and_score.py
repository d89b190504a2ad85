"""Scoring overlaps sampling (megaflow.run.requests.generate_and_score): each group is scored as soon as it is back.
Needs: CPU, 1 process, ~3 s (a fake engine and a fake per-image reward, both with sleeps).

Checked against the sequential path written out here (generate everything, score one batch, advantages):
rewards, components and advantages bit for bit equal, same trajectories in the same order. The overlap is
checked by order, not by time: the engine samples group g only once group g-1 has gone to the scorer (a
sample-then-score path never hands a group over before every group is sampled, and the engine's wait for
it times out). How much the overlap saves is a benchmark's question (``megaflow bench``), not a test's.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from megaflow.algo.advantages import AdvantageConfig, group_advantages
from megaflow.config import load_config
from megaflow.run.requests import generate_and_score
from megaflow.rewards.base import Reward
from megaflow.rewards.scorer import AsyncScorer, MultiReward
from megaflow.rollout.types import RolloutRequest

GROUPS, SIZE, SAMPLE_S, SCORE_S = 4, 8, 0.3, 0.01


class SlowEngine:
    """Samples one group at a time (like an engine running one call after another); images from the seed."""

    engine_id = "slow"

    def __init__(self):
        self._pool = ThreadPoolExecutor(1)

    def _sample(self, r: RolloutRequest):
        time.sleep(SAMPLE_S)
        out = []
        for j, seed in enumerate(r.output_seeds()):
            g = torch.Generator().manual_seed(seed)
            out.append(SimpleNamespace(image=torch.rand(3, 8, 8, generator=g), prompt=r.prompt, index=j, seed=seed))
        return out

    def submit(self, requests):
        return [self._pool.submit(self._sample, r) for r in requests]

    def generate(self, requests):
        return [t for f in self.submit(requests) for t in f.result()]


class GatedEngine(SlowEngine):
    """Samples group g > 0 only after group g - 1 went to the scorer (``handed_over[g - 1]``); records a wait
    that timed out (the group was not handed over while the others still sampled)."""

    def __init__(self, handed_over: list[threading.Event]):
        super().__init__()
        self.handed_over, self.timed_out = handed_over, []

    def _sample(self, r: RolloutRequest):
        g = int(r.request_id.removeprefix("g"))
        if g > 0 and not self.handed_over[g - 1].wait(timeout=10):
            self.timed_out.append(g)
        return super()._sample(r)


class RecordingScorer:
    """Passes ``submit`` on to ``scorer`` and marks the submitted group as handed over."""

    def __init__(self, scorer, handed_over: list[threading.Event]):
        self.scorer, self.handed_over = scorer, handed_over

    def submit(self, images, prompts, metadata=None):
        self.handed_over[[r.prompt for r in _requests()].index(prompts[0])].set()
        return self.scorer.submit(images, prompts, metadata)


class SlowReward(Reward):
    name = "slow"

    def __call__(self, images, prompts, metadata=None):
        time.sleep(SCORE_S * len(prompts))
        return images.float().mean(dim=(1, 2, 3)) * 3 + torch.tensor([len(p) % 3 for p in prompts]) * 0.1


def _cfg():
    return load_config(None, [f"rollout.group_size={SIZE}", "algo.std_mode=group", "algo.adv_clip=5.0"])


def _requests():
    return [RolloutRequest(prompt=f"prompt number {g}{'x' * g}", num_outputs=SIZE, seed=100 * g, num_steps=2,
                           request_id=f"g{g}") for g in range(GROUPS)]


def _sequential(engine, scorer):
    trajs = engine.generate(_requests())
    scores = scorer.submit(torch.stack([t.image for t in trajs]), [t.prompt for t in trajs]).result()
    adv = group_advantages(scores.total, torch.arange(len(trajs)) // SIZE,
                           AdvantageConfig(adv_clip=5.0, std_mode="group", filter_zero_std=True))
    return trajs, scores, adv


def test_overlapped_equals_sequential_and_hands_each_group_over_once_back():
    handed_over = [threading.Event() for _ in range(GROUPS)]
    engine = GatedEngine(handed_over)
    with AsyncScorer(MultiReward([("slow", 1.0, SlowReward()), ("half", 0.5, SlowReward())])) as scorer:
        trajs, scores, adv = _sequential(SlowEngine(), scorer)
        got_trajs, got_adv, got_keep, metrics = generate_and_score(engine, RecordingScorer(scorer, handed_over),
                                                                   _requests(), _cfg())
    assert [(t.prompt, t.seed) for t in got_trajs] == [(t.prompt, t.seed) for t in trajs]
    assert torch.equal(got_adv, adv.advantages) and torch.equal(got_keep, adv.keep)
    assert metrics["reward/total"] == scores.summary()["reward/total"]
    assert metrics["reward/slow"] == scores.summary()["reward/slow"]
    assert bool((adv.advantages != 0).any())
    assert engine.timed_out == [], "groups sampled before the previous group went to the scorer"
    assert all(e.is_set() for e in handed_over)
