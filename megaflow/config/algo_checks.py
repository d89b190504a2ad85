"""The cross-field rules of the clean-sample algorithms (nft, awm, dgpo), called by preflight and the run module.
Invariant: each check raises one ConfigError line naming the key and the value it needs, before anything heavy.
"""
from __future__ import annotations

from megaflow.config.load import ConfigError
from megaflow.config.schema import MegaflowConfig
from megaflow.families import card


def _check_ode_rollouts(cfg: MegaflowConfig) -> None:
    """Deterministic rollouts without CFG and without FlowGRPO's log-prob settings."""
    r, a, name = cfg.rollout, cfg.algo, cfg.algo.name
    if r.sde_type != "ode":
        raise ConfigError(f"algo.name = {name!r} trains on clean ODE samples: set rollout.sde_type = 'ode' "
                          f"(got {r.sde_type!r})")
    if r.sde_window or r.sde_window_size or r.sde_window_range:
        raise ConfigError(f"rollout.sde_window / sde_window_size / sde_window_range are FlowGRPO's; algo.name = "
                          f"{name!r} samples every step with the ODE")
    if a.mismatch != "none":
        raise ConfigError(f"algo.mismatch = {a.mismatch!r} corrects FlowGRPO's log-prob ratio; algo.name = {name!r} "
                          "has none (use 'none')")
    if card(cfg.model.family).uses_cfg(r.guidance_scale):
        raise ConfigError(f"rollout.guidance_scale = {r.guidance_scale} turns on CFG; algo.name = {name!r} samples "
                          "and trains without it (use 1.0)")


def check_nft(cfg: MegaflowConfig) -> None:
    """DiffusionNFT samples deterministically, without CFG, and trains grid timesteps of the sampler."""
    _check_ode_rollouts(cfg)
    r, a = cfg.rollout, cfg.algo
    if a.nft_num_timesteps > r.num_steps:
        raise ConfigError(f"algo.nft_num_timesteps = {a.nft_num_timesteps} exceeds rollout.num_steps = {r.num_steps} "
                          "(the sampler's grid it draws from)")


def _check_fast_ema(cfg: MegaflowConfig) -> None:
    if cfg.algo.old_decay_flat_steps:
        raise ConfigError(f"algo.old_decay_flat_steps = {cfg.algo.old_decay_flat_steps} is DiffusionNFT's; "
                          f"algo.name = {cfg.algo.name!r} blends its fast EMA from the first step (use 0)")


def check_awm(cfg: MegaflowConfig) -> None:
    """AWM: ODE rollouts without CFG; one uniform draw in each of awm_num_timesteps non-empty strata of
    [1, int(num_steps * timestep_fraction)] (megaflow.algo.awm.awm_timestep_indices)."""
    _check_ode_rollouts(cfg)
    _check_fast_ema(cfg)
    r, a = cfg.rollout, cfg.algo
    top = int(r.num_steps * a.timestep_fraction)
    if a.awm_num_timesteps > top - 1:
        raise ConfigError(f"algo.awm_num_timesteps = {a.awm_num_timesteps} needs at most int(rollout.num_steps * "
                          f"algo.timestep_fraction) - 1 = {top - 1} (num_steps {r.num_steps}, fraction "
                          f"{a.timestep_fraction}): one stratum of grid indices 1 .. {top} per timestep")


def check_dgpo(cfg: MegaflowConfig) -> None:
    """DGPO: ODE rollouts without CFG; dgpo_num_timesteps distinct grid indices <= dgpo_trunc_steps < num_steps;
    one optimizer step per rollout batch, whose group scores are taken before it."""
    _check_ode_rollouts(cfg)
    _check_fast_ema(cfg)
    r, a, t = cfg.rollout, cfg.algo, cfg.train
    if a.dgpo_trunc_steps >= r.num_steps:
        raise ConfigError(f"algo.dgpo_trunc_steps = {a.dgpo_trunc_steps} must be < rollout.num_steps = "
                          f"{r.num_steps} (the last grid index it may draw)")
    if a.dgpo_num_timesteps > a.dgpo_trunc_steps + 1:
        raise ConfigError(f"algo.dgpo_num_timesteps = {a.dgpo_num_timesteps} exceeds the {a.dgpo_trunc_steps + 1} "
                          f"grid indices 0 .. algo.dgpo_trunc_steps it draws from without replacement")
    if t.num_minibatches != 1 or t.num_inner_epochs != 1:
        raise ConfigError(f"algo.name = 'dgpo' makes one optimizer step per rollout batch (its group scores are "
                          f"taken before it): set train.num_minibatches = 1 and train.num_inner_epochs = 1 (got "
                          f"{t.num_minibatches} and {t.num_inner_epochs})")


CLEAN_SAMPLE_ALGORITHMS = {"nft": check_nft, "awm": check_awm, "dgpo": check_dgpo}
"""algo.name -> its check."""
