"""What changes from one iteration to the next on a trainer rank: the last iteration done, the metrics rows, the
policy version the engines hold and the batch collected ahead. The built pieces (megaflow.run.build.Run) do not
change; invariant: a checkpoint of iteration k holds this state as it is after k, so a resumed run continues it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megaflow.run.ahead import Batch


@dataclass
class LoopState:
    """The loop's state after ``iteration`` (0: before the first; a resumed run: the checkpoint's iteration)."""

    iteration: int = 0
    history: list[dict] = field(default_factory=list)
    """Every metrics row so far (a resumed run: the checkpoint's)."""
    engine_version: int = 0
    """The iterations whose update the engines hold (the policy version they sample)."""
    next_batch: Batch | None = None
    """The batch collected ahead for ``iteration + 1`` (asynchronous loop), or None."""

    def done(self, it: int, row: dict, next_batch: Batch | None) -> None:
        """Iteration ``it`` trained and its weights reached the engines: its metrics ``row`` recorded."""
        self.iteration, self.engine_version, self.next_batch = it, it, next_batch
        self.history.append({"iteration": it, **row})
