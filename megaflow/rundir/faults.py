"""Fault injection for the crash/resume tests: ``MEGAFLOW_FAULT="<point>@<iteration>[:<rank>]"`` SIGKILLs the
process at ``point`` (``rollout``, ``train``, ``sync``, ``checkpoint``) in ``iteration``. Unset, :func:`check`
is a dict lookup.
"""
from __future__ import annotations

import os
import signal

POINTS = ("rollout", "train", "sync", "checkpoint")


def _parse(spec: str) -> tuple[str, int, int | None] | None:
    if not spec:
        return None
    where, _, rank = spec.partition(":")
    point, _, iteration = where.partition("@")
    if point not in POINTS or not iteration.isdigit() or (rank and not rank.isdigit()):
        raise ValueError(f"MEGAFLOW_FAULT={spec!r}: expected <point>@<iteration>[:<rank>], point one of {POINTS}")
    return point, int(iteration), int(rank) if rank else None


_FAULT = _parse(os.environ.get("MEGAFLOW_FAULT", ""))


def check(point: str, iteration: int) -> None:
    """SIGKILL this process if the injected fault is ``point`` at ``iteration`` (and this rank)."""
    if _FAULT is None or _FAULT[:2] != (point, iteration):
        return
    rank = int(os.environ.get("RANK", "0"))
    if _FAULT[2] is None or _FAULT[2] == rank:
        os.kill(os.getpid(), signal.SIGKILL)
