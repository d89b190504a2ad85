"""Weighted multi-reward and the asynchronous scorer. ``MultiReward`` returns the total sum_i w_i * r_i plus each
component, its time and info. Invariant: a sample masked (NaN) by any weighted component is NaN in the total.
Design notes: docs/design/rewards.md.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from megaflow.rewards.base import ImageBatch, Reward, batch_size, note_failure, score_with_info
from megaflow.rollout.types import RewardScores

logger = logging.getLogger("megaflow.rewards")


class RewardTimeout(Exception):
    """A call did not return within its time limit (it is left running on its daemon thread)."""


def call_within(fn: Callable[[], object], timeout_s: float, *, name: str) -> object:
    """``fn()``, or :class:`RewardTimeout` when it has not returned after ``timeout_s`` seconds (0 = wait as
    long as it takes, on the caller's thread). With a limit it runs on a new daemon thread that is abandoned
    on timeout: nothing can stop it, so it finishes (or not) in the background and its result is dropped."""
    if not timeout_s:
        return fn()
    box: dict = {}

    def target() -> None:
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["err"] = e
    thread = threading.Thread(target=target, name=f"megaflow-reward-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardTimeout(f"no result after {timeout_s:g} s (reward.timeout_s); its call is abandoned")
    if "err" in box:
        raise box["err"]
    return box["out"]


class MultiReward(Reward):
    """Weighted sum of labelled rewards; each component also reported."""

    name = "multi"

    def __init__(self, components: Sequence[tuple[str, float, Reward]], *, timeout_s: float = 0.0):
        if not components:
            raise ValueError("a multi-reward needs at least one component")
        labels = [c[0] for c in components]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"duplicate reward label(s) {dup}: give each a distinct 'label'")
        for label, weight, _ in components:
            if not np.isfinite(weight):
                raise ValueError(f"reward {label!r} has non-finite weight {weight}")
        if not timeout_s >= 0.0:
            raise ValueError(f"timeout_s must be >= 0 (0 = no limit), got {timeout_s}")
        self.components = [(label, float(w), r) for label, w, r in components]
        self.timeout_s = float(timeout_s)

    def score(self, images: ImageBatch, prompts: Sequence[str],
              metadata: Sequence[dict] | None = None) -> RewardScores:
        comps, secs, info, timeouts = {}, {}, {}, {}
        for label, _, reward in self.components:
            t0 = time.perf_counter()
            comps[label], extra, timeouts[label] = self._component(label, reward, images, prompts, metadata)
            secs[label] = time.perf_counter() - t0
            info.update({f"{label}/{key}": value for key, value in extra.items()})
        total = torch.zeros(len(prompts))
        for label, w, _ in self.components:
            if w != 0.0:  # weight 0 = reported only: neither counted nor masking
                total = total + w * comps[label]
        return RewardScores(total=total, components=comps, seconds=secs,
                            weights={label: w for label, w, _ in self.components}, info=info, timeouts=timeouts)

    def _component(self, label: str, reward: Reward, images: ImageBatch, prompts: Sequence[str],
                   metadata: Sequence[dict] | None) -> tuple[torch.Tensor, dict, int]:
        """One component on the batch: (scores, info, 1 if it timed out and was masked else 0)."""
        try:
            scores, extra = call_within(lambda: score_with_info(reward, images, prompts, metadata, name=label),
                                        self.timeout_s, name=label)
            return scores, extra, 0
        except RewardTimeout as e:
            logger.warning("reward %s: batch of %d masked: %s", label, len(prompts), e)
            note_failure(label, f"timed out: {e}")
            return torch.full((batch_size(images),), float("nan")), {}, 1

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
        """Drop the batches not started yet and wait for the running ones (each bounded by the reward's
        ``timeout_s`` when it has one)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> AsyncScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
