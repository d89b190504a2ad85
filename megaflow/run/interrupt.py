"""Ctrl-C / SIGTERM during a run: the first signal asks the run to stop after the current iteration (its
checkpoint is saved and the engines shut down, then :class:`Interrupted` is raised); a second one abandons
at once (KeyboardInterrupt, engines still shut down by the loop's ``finally``); a repeat within
``DUPLICATE_S`` seconds counts as the same request (Ctrl-C reaches torchrun's workers twice: from the
terminal and forwarded by torchrun). The CLI turns either into one line and exit code 130 (SIGINT) or 143
(SIGTERM); under torchrun the launcher's own exit code is its own (1 after a signal).
"""
from __future__ import annotations

import signal
import threading
import time

DUPLICATE_S = 2.0


class Interrupted(RuntimeError):
    def __init__(self, signum: int, iteration: int, checkpoint: str | None):
        self.signum, self.iteration, self.checkpoint = signum, iteration, checkpoint
        saved = f"checkpoint {checkpoint}; continue with --resume" if checkpoint else "no checkpoint written"
        super().__init__(f"stopped by {signal.Signals(signum).name} after iteration {iteration} ({saved})")


class StopRequests:
    """Installs the handlers (main thread only; elsewhere it never requests a stop)."""

    def __init__(self):
        self.signum, self._first = 0, 0.0
        self._saved: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._saved[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum:
            if time.monotonic() - self._first < DUPLICATE_S:
                return  # the same stop again: a launcher (torchrun) passes a terminal's Ctrl-C on to its workers
            raise KeyboardInterrupt  # second signal: abandon now
        self.signum, self._first = signum, time.monotonic()
        print(f"\n[megaflow] {signal.Signals(signum).name}: stopping after this iteration (again to abandon)",
              flush=True)

    def agreed(self) -> int:
        """The signal every rank agrees to stop for (0 = go on): any rank's request stops them all at the
        same iteration boundary (an all-reduce, so ranks never disagree on when to save and exit)."""
        import torch
        import torch.distributed as dist
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self.signum
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def restore(self) -> None:
        for s, handler in self._saved.items():
            signal.signal(s, handler)
        self._saved.clear()
