"""An iteration's scored batch, and the batch sampled ahead by the asynchronous loop (``train.max_staleness = 1``).
Design notes: docs/design/run.md.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from megaflow.rollout.types import RewardScores, RolloutRequest, Trajectory

BATCH_TENSORS = "next_batch.safetensors"
BATCH_META = "next_batch.json"


@dataclass
class Batch:
    iteration: int
    """The iteration that trains on it."""
    version: int
    """The policy version that sampled it: the iterations whose update the engines held."""
    requests: list[RolloutRequest]
    trajs: list[Trajectory]
    scores: RewardScores
    timings: dict


class PendingBatch:
    """A batch being collected (:func:`start_batch`); ``finish()`` once, on every trainer rank."""

    def __init__(self, pending, iteration: int, version: int, requests: list[RolloutRequest]):
        self.pending, self.iteration, self.version, self.requests = pending, iteration, version, requests

    def finish(self) -> Batch:
        trajs, scores, timings = self.pending.finish()
        return Batch(self.iteration, self.version, self.requests, trajs, scores, timings)


def start_batch(run, iteration: int, version: int) -> PendingBatch:
    """Start collecting ``iteration``'s batch with the weights the engines hold now, ``version`` (the iterations
    whose update they hold: ``iteration - 1`` in the synchronous loop, one less when collected ahead)."""
    requests = run.algorithm.requests(run.prompts, iteration)
    return PendingBatch(run.rollout.start(requests, iteration), iteration, version, requests)


def write_batch(directory: Path, batch: Batch) -> None:
    """``batch`` into ``directory`` (a checkpoint being written): tensors and JSON, no pickle."""
    from safetensors.torch import save_file

    from megaflow.rollout.exchange import pack_share
    tensors = {k: v.contiguous() for k, v in pack_share(batch.trajs, batch.scores, 0.0).items()}
    save_file(tensors, str(directory / BATCH_TENSORS))
    meta = {"iteration": batch.iteration, "version": batch.version, "timings": batch.timings,
            "requests": [dataclasses.asdict(r) for r in batch.requests],
            "engine_ids": [t.engine_id for t in batch.trajs]}
    (directory / BATCH_META).write_text(json.dumps(meta, default=float))


def read_batch(directory: Path) -> Batch | None:
    """The batch a checkpoint holds (None when it holds none); ValueError naming the file when unreadable."""
    if not (directory / BATCH_META).exists():
        return None
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from megaflow.rollout.exchange import unpack_share
    try:
        meta = json.loads((directory / BATCH_META).read_text())
        tensors = load_file(str(directory / BATCH_TENSORS))
        requests = [RolloutRequest(**r) for r in meta["requests"]]
        trajs, scores = unpack_share(tensors, requests, host=0)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:
        raise ValueError(f"{directory / BATCH_META}: unreadable batch collected ahead "
                         f"({type(e).__name__}: {e})") from None
    for t, engine_id in zip(trajs, meta["engine_ids"]):
        t.engine_id = engine_id
    return Batch(meta["iteration"], meta["version"], requests, trajs, scores, meta["timings"])
