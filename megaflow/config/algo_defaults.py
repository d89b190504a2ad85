"""Per-algorithm defaults: the value a field takes, by ``algo.name``, when the config leaves it out (neither the
run file nor a ``--set`` names it). The one place they live; ``megaflow config show`` lists them.

The invariant: a resolved config (the run dir's ``config.toml``) names every field, so loading it again
applies none of these and gives the same config.

Design notes: docs/design/config.md.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megaflow.config.schema import MegaflowConfig


@dataclass(frozen=True)
class AlgorithmDefault:
    key: str
    """``section.field``."""
    value: Callable[[MegaflowConfig], object]
    """The default, from the rest of the config (read after every explicit value is in)."""
    rule: str
    """How ``config show`` states it."""


DEFAULTS: dict[str, tuple[AlgorithmDefault, ...]] = {
    "flowgrpo": (
        AlgorithmDefault("algo.kl_beta", lambda c: 0.04, "0.04 (flow_grpo)"),
    ),
    "nft": (
        AlgorithmDefault("algo.kl_beta", lambda c: 1e-4 if c.lora.rank > 0 else 0.0,
                         "1e-4 (the paper's) with LoRA, whose reference is the model with the adapters off; "
                         "else 0 (no second model is built for it)"),
        AlgorithmDefault("algo.nft_num_timesteps",
                         lambda c: max(1, int(c.rollout.num_steps * c.algo.timestep_fraction)),
                         "int(rollout.num_steps * algo.timestep_fraction), the published 9 of 10"),
    ),
}


def apply_algorithm_defaults(cfg: MegaflowConfig, explicit: set[str]) -> MegaflowConfig:
    """Set every per-algorithm default of ``cfg.algo.name`` whose key is not in ``explicit`` (``section.field``
    names the config set)."""
    for d in DEFAULTS.get(cfg.algo.name, ()):
        if d.key not in explicit:
            section, name = d.key.split(".")
            setattr(getattr(cfg, section), name, d.value(cfg))
    return cfg


def describe(algo: str) -> list[str]:
    """``config show``'s comment lines: the per-algorithm defaults of ``algo``."""
    lines = [f"# Defaults of algo.name = {algo!r} for the fields a config leaves out (megaflow.config.algo_defaults):"]
    lines += [f"#   {d.key} = {d.rule}" for d in DEFAULTS.get(algo, ())]
    return lines
