"""The field helper of megaflow's config dataclasses and the upper bounds of their integer fields.
Invariant: standard library only, so a config is checked before torch, megatron or sglang load.
"""
from __future__ import annotations

from dataclasses import field
from typing import Any

# Upper bounds of integer fields: beyond them a value is a typo, and would overflow or exhaust memory later.
SEED_MAX = 2**32 - 1  # seeds reach torch.Generator.manual_seed as seed * 1_000_003 + ... (megaflow.seeds)
MAX_STEPS = 1000  # denoising steps: the sigma grid and the per-step trajectories are built in memory
MAX_SIDE = 8192  # image side in pixels
MAX_FRAMES = 1024  # frames of a video rollout
MAX_ITERS = 100_000_000  # iteration and optimizer-step counts


def opt(default: Any, help: str, **checks: Any) -> Any:
    """A dataclass field with a help string and optional checks (ge, gt, le, lt, choices; ``items``: the
    type every element of a list must have)."""
    meta = {"help": help, **checks}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)
