"""Weighted multi-reward and the asynchronous scorer that keeps rewards off the critical path.

``MultiReward`` runs each component through ``safe_score`` and returns ``RewardScores``: the total
sum_i w_i * r_i plus every raw component, its wall time and the info it reported (``(scores, info)``
rewards: ``info["<label>/<key>"]``, logged as ``reward/<label>/<key>``). A sample masked (NaN) by any weighted
component is NaN in the total, so the mask propagates to advantages (the caller drops NaN samples);
a weight-0 component is only reported.

``AsyncScorer.submit(images, prompts)`` returns a ``concurrent.futures.Future`` of the same
``RewardScores`` that ``score`` gives synchronously; the rollout loop submits a batch and goes on
sampling the next one. Threads, not processes: the heavy parts (PIL encode, numpy, torch) release
the GIL, and a thread shares loaded weights (the CIFAR CNN) with no pickling or re-import cost.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from megaflow.rewards.base import ImageBatch, Reward, score_with_info
from megaflow.rollout.types import RewardScores


class MultiReward(Reward):
    """Weighted sum of labelled rewards; each component also reported."""

    name = "multi"

    def __init__(self, components: Sequence[tuple[str, float, Reward]]):
        if not components:
            raise ValueError("a multi-reward needs at least one component")
        labels = [c[0] for c in components]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"duplicate reward label(s) {dup}: give each a distinct 'label'")
        for label, weight, _ in components:
            if not np.isfinite(weight):
                raise ValueError(f"reward {label!r} has non-finite weight {weight}")
        self.components = [(label, float(w), r) for label, w, r in components]

    def score(self, images: ImageBatch, prompts: Sequence[str],
              metadata: Sequence[dict] | None = None) -> RewardScores:
        comps, secs, info = {}, {}, {}
        for label, _, reward in self.components:
            t0 = time.perf_counter()
            comps[label], extra = score_with_info(reward, images, prompts, metadata, name=label)
            secs[label] = time.perf_counter() - t0
            info.update({f"{label}/{key}": value for key, value in extra.items()})
        total = torch.zeros(len(prompts))
        for label, w, _ in self.components:
            if w != 0.0:  # weight 0 = reported only: neither counted nor masking
                total = total + w * comps[label]
        return RewardScores(total=total, components=comps, seconds=secs,
                            weights={label: w for label, w, _ in self.components}, info=info)

    def __call__(self, images: ImageBatch, prompts: Sequence[str],
                 metadata: Sequence[dict] | None = None) -> torch.Tensor:
        return self.score(images, prompts, metadata).total


def _snapshot(images: ImageBatch) -> ImageBatch:
    """A private copy, so the sampler may reuse its buffers while scoring runs."""
    if isinstance(images, torch.Tensor):
        return images.detach().to("cpu", copy=True)
    if isinstance(images, np.ndarray):
        return images.copy()
    return [im.copy() for im in images]


class AsyncScorer:
    """Scores batches on a thread pool: ``submit`` -> Future[RewardScores]; ``score`` is the
    synchronous equivalent (same code path). Use as a context manager or call ``close``."""

    def __init__(self, reward: MultiReward, *, num_workers: int = 1):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.reward = reward
        self._pool = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="megaflow-reward")

    def score(self, images: ImageBatch, prompts: Sequence[str],
              metadata: Sequence[dict] | None = None) -> RewardScores:
        return self.reward.score(images, prompts, metadata)

    def submit(self, images: ImageBatch, prompts: Sequence[str],
               metadata: Sequence[dict] | None = None) -> Future:
        meta = None if metadata is None else [dict(m) for m in metadata]
        return self._pool.submit(self.reward.score, _snapshot(images), list(prompts), meta)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> AsyncScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
