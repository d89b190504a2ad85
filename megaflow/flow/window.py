"""The SDE window: which denoising steps are stochastic (and trained). :func:`check_sde_window` is the one home
of its settings' rules (preflight and the loop apply it); :func:`sample_sde_window` draws FlowGRPO-Fast's.
"""
from __future__ import annotations

from collections.abc import Sequence


def check_sde_window(*, num_steps: int, window: Sequence[int], window_size: int, window_range: Sequence[int],
                     sde_type: str) -> tuple[int, int] | None:
    """The range ``(lo, hi)`` a window is drawn from, or None when there is no drawn window (the fixed
    ``window``, or every step when it is empty); ValueError naming the ``rollout.*`` settings that do not fit
    together (both a fixed and a drawn window, a range outside the steps or narrower than the window, a
    CPS window of one step that can be the deterministic last step)."""
    if window_size == 0:
        if window_range:
            raise ValueError(f"rollout.sde_window_range = {window_range} needs rollout.sde_window_size > 0")
        return None
    if window:
        raise ValueError(f"rollout.sde_window = {window} and rollout.sde_window_size = {window_size}: "
                         "set one of them (a fixed window or one drawn every iteration)")
    if window_range and len(window_range) != 2:
        raise ValueError(f"rollout.sde_window_range = {window_range}: expected [lo, hi]")
    lo, hi = window_range or (0, num_steps)
    where = f"rollout.sde_window_size = {window_size} / sde_window_range = {[lo, hi]}"
    if not 0 <= lo < hi <= num_steps:
        raise ValueError(f"{where}: the range must satisfy 0 <= lo < hi <= num_steps={num_steps}")
    if not 1 <= window_size <= hi - lo:
        raise ValueError(f"{where}: window_size must be in [1, {hi - lo}]")
    if sde_type == "cps" and window_size == 1 and hi == num_steps:
        raise ValueError("rollout.sde_window_size = 1 with cps can draw the last step alone (deterministic, "
                         "nothing to train): use a size >= 2 or sde_window_range ending before num_steps")
    return lo, hi


def sample_sde_window(num_steps: int, window_size: int, *, window_range: tuple[int, int] | None = None,
                      generator=None) -> list[int]:
    """FlowGRPO-Fast window: ``window_size`` consecutive indices starting uniformly in ``[lo, hi − window_size]``,
    from ``generator``; ValueError when it does not fit."""
    import torch

    lo, hi = check_sde_window(num_steps=num_steps, window=(), window_size=window_size,
                              window_range=window_range or (0, num_steps), sde_type="sde")
    start = int(torch.randint(lo, hi - window_size + 1, (1,), generator=generator))
    return list(range(start, start + window_size))
