"""The run's one seeding rule: every random draw of an iteration is a pure function of (``run.seed``, the
iteration, a stream number), so every rank draws the same without communication and a resumed run draws
what the uninterrupted one did.

Streams: 0 the rollout noise (each group's first sample seed, megaflow.run.requests.make_requests), 1 the
SDE window (FlowGRPO-Fast), 2 the trainer's minibatch shuffle, 3 the groups' assignment to engine hosts
(megaflow.rollout.hosted).
"""
from __future__ import annotations

ROLLOUT, SDE_WINDOW, MINIBATCHES, HOST_PLAN = 0, 1, 2, 3


def iteration_seed(seed: int, iteration: int, stream: int) -> int:
    """The seed of ``stream`` in ``iteration`` of a run seeded with ``seed``."""
    return seed * 1_000_003 + iteration * 10_007 + stream
