"""Which config changes a resumed run accepts: the one table of fields that may differ from the checkpointed run's.

Invariant: a field may change on resume only when the resumed run's training stays a continuation of the same run
(evaluation, logging, learning rate and schedule length, iterations, save cadence, timeouts); every other difference
is refused naming the field, unless the user names it in ``--resume-override``. Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Whole sections a resumed run may change: they only observe the run.
MAY_CHANGE_SECTIONS = frozenset({"logging", "eval"})
# Single fields a resumed run may change: how long it runs, its learning rate (a function of the config and the
# iteration, trainer/settings.LRSchedule), when it saves, and how long it waits.
MAY_CHANGE_KEYS = frozenset({
    ("train", "iterations"), ("train", "lr"), ("train", "warmup_iterations"), ("train", "lr_schedule"),
    ("train", "save_every"), ("train", "keep_checkpoints"), ("train", "max_masked_iterations"),
    ("reward", "timeout_s"), ("reward", "num_workers"), ("parallel", "timeout_s"),
})


@dataclass(frozen=True)
class Change:
    key: str
    before: Any
    after: Any

    def __str__(self) -> str:
        return f"{self.key} {self.before!r} -> {self.after!r}"


def may_change(section: str, key: str) -> bool:
    """Whether ``section.key`` may differ on resume without ``--resume-override``."""
    return section in MAY_CHANGE_SECTIONS or (section, key) in MAY_CHANGE_KEYS


def config_changes(before: dict, after: dict) -> list[Change]:
    """Every ``section.key`` whose value in ``after`` differs from ``before`` (both parsed configs,
    ``{section: {key: value}}``); a key ``before`` lacks (a run saved before it existed) is taken as unchanged."""
    changes = []
    for section, values in after.items():
        old = before.get(section)
        old = old if isinstance(old, dict) else {}
        for key, value in values.items():
            if key in old and old[key] != value:
                changes.append(Change(f"{section}.{key}", old[key], value))
    return changes


def refused_change(changes: list[Change], overrides: tuple[str, ...] = ()) -> Change | None:
    """The first change that neither ``may_change`` nor is named in ``overrides`` (dotted keys)."""
    for change in changes:
        section, _, key = change.key.partition(".")
        if not may_change(section, key) and change.key not in overrides:
            return change
    return None


def describe_changes(changes: list[Change], overrides: tuple[str, ...] = ()) -> str:
    """One line listing what a resumed run changed (overridden fields marked), or '' when nothing did."""
    if not changes:
        return ""
    parts = [f"{c}{' (--resume-override)' if c.key in overrides else ''}" for c in changes]
    return "[megaflow] --resume with a changed config: " + ", ".join(parts)
