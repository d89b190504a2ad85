"""Per-algorithm defaults: a field's value, by ``algo.name``, when the config leaves it out; ``megaflow config
show`` lists them. Invariant: a resolved config names every field, so reloading it applies none of these.
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


_CLEAN_SAMPLE_SHARED = (  # AWM's and DGPO's authors (docs/algorithms/awm.md, dgpo.md)
    AlgorithmDefault("algo.kl_beta", lambda c: 1e-3 if c.lora.rank > 0 else 0.0,
                     "1e-3 (AWM's GenEval beta, DGPO's EMA-reference kl beta) with LoRA, whose reference is the "
                     "model with the adapters off; else 0 (no second model is built for it)"),
    AlgorithmDefault("algo.old_decay_max", lambda c: 0.3, "0.3, the fast EMA's d = min(0.3, 0.001 * steps)"),
    AlgorithmDefault("algo.filter_zero_std", lambda c: False, "false (zero-std groups stay, with advantage 0)"),
)

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
    "awm": (
        *_CLEAN_SAMPLE_SHARED,
        AlgorithmDefault("algo.timestep_fraction", lambda c: 0.9, "0.9 (the authors' timestep_fraction)"),
        AlgorithmDefault("algo.awm_num_timesteps",
                         lambda c: max(1, min(6, int(c.rollout.num_steps * c.algo.timestep_fraction) - 1)),
                         "min(6, int(rollout.num_steps * algo.timestep_fraction) - 1), the authors' 6 of 14"),
    ),
    "dgpo": (
        *_CLEAN_SAMPLE_SHARED,
        AlgorithmDefault("algo.std_mode", lambda c: "group", "'group' (the authors' GenEval global_std = False)"),
        AlgorithmDefault("algo.dgpo_trunc_steps", lambda c: min(4, c.rollout.num_steps - 1),
                         "min(4, rollout.num_steps - 1), the authors' trunc_steps 4 of 10"),
        AlgorithmDefault("algo.dgpo_num_timesteps", lambda c: min(4, c.algo.dgpo_trunc_steps + 1),
                         "min(4, algo.dgpo_trunc_steps + 1), the authors' num_train_timesteps"),
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
