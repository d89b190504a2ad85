"""``MaskedWatch``: after ``train.max_masked_iterations`` iterations in a row whose every sample the rewards
masked (or at the last iteration when all were), says why in one line; the loop checkpoints and stops with
:class:`UselessRun`. Every rank sees the same scores, so all stop at the same iteration.
"""
from __future__ import annotations

import torch

from megaflow.rewards.base import last_failure
from megaflow.rollout.types import RewardScores


class UselessRun(ValueError):
    """The rewards masked every sample for ``train.max_masked_iterations`` iterations in a row (one line)."""


class MaskedWatch:
    """``see(scores)`` once per iteration; ``verdict(it)`` is the stop message once ``limit`` iterations in a
    row had every sample masked (0 = never)."""

    def __init__(self, limit: int):
        self.limit, self.streak, self.seen, self.culprits = limit, 0, 0, {}

    def see(self, scores: RewardScores) -> None:
        self.seen += 1
        if bool(scores.valid.any()):
            self.streak, self.culprits = 0, {}
            return
        self.streak += 1
        masking = {label: c for label, c in scores.components.items() if scores.weights.get(label, 0.0) != 0.0}
        everywhere = [label for label, c in masking.items() if not bool(torch.isfinite(c).any())]
        for label in everywhere or [label for label, c in masking.items() if not bool(torch.isfinite(c).all())]:
            self.culprits[label] = last_failure(label) or "masked every sample (see the reward warnings above)"

    def verdict(self, it: int, *, last: bool = False) -> str | None:
        """The stop message after iteration ``it`` (``last``: the run's last one), or None to go on."""
        whole_run = last and self.streak and self.streak == self.seen
        if not self.limit or (self.streak < self.limit and not whole_run):
            return None
        why = "; ".join(f"reward {label!r}: {reason}" for label, reason in self.culprits.items())
        how = ("every iteration of this run was one" if self.streak < self.limit else
               f"stopped after train.max_masked_iterations = {self.limit} such iterations")
        return (f"every sample of iterations {it - self.streak + 1}..{it} was masked ({why or 'no reward scored'}), "
                f"so nothing trained: {how}")
