"""The SDE window: which denoising steps of a rollout are stochastic (and trained), and the rules its settings
follow.

FlowGRPO samples every step with the SDE, or a fixed set of steps (``rollout.sde_window``); FlowGRPO-Fast
draws a window of ``rollout.sde_window_size`` consecutive steps anew every iteration inside
``rollout.sde_window_range`` (:func:`sample_sde_window`). :func:`check_sde_window` is the one home of the rules
these settings follow, in the config's words: the config preflight applies it before anything heavy is
imported and the loop before it draws a window. Standard library at import (torch only to draw a window).
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
    """FlowGRPO-Fast window: ``window_size`` consecutive step indices starting uniformly in
    ``[lo, hi − window_size]`` of ``window_range = (lo, hi)`` (default ``(0, num_steps)``), drawn from the
    ``torch.Generator`` ``generator``; ValueError (:func:`check_sde_window`) for a window that does not fit.

    Same distribution as flow_grpo's ``random.randint(lo, hi - size)`` start; the result is meant for
    ``rollout_sde_step_indices`` and for selecting the steps to train.
    """
    import torch

    lo, hi = check_sde_window(num_steps=num_steps, window=(), window_size=window_size,
                              window_range=window_range or (0, num_steps), sde_type="sde")
    start = int(torch.randint(lo, hi - window_size + 1, (1,), generator=generator))
    return list(range(start, start + window_size))
