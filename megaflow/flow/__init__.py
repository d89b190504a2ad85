"""Flow-matching math shared by the trainer and the engine: sigma grids and one-step transitions.

Pure functions of tensors (no scheduler state); the numbers equal SGLang's rollout and diffusers' grids.
"""
from megaflow.flow.schedule import check_sigmas, flux_mu, flux_sigmas, sd3_sigmas, shift_sigmas
from megaflow.flow.step import (
    StepResult,
    TransitionConfig,
    config_for_step,
    gaussian_log_prob,
    sample_sde_window,
    sde_step_mask,
    sigma_max_of,
    step,
    transition_log_prob,
    transition_mean_std,
)

__all__ = [
    "check_sigmas", "flux_mu", "flux_sigmas", "sd3_sigmas", "shift_sigmas",
    "StepResult", "TransitionConfig", "config_for_step", "gaussian_log_prob", "sample_sde_window",
    "sde_step_mask", "sigma_max_of", "step", "transition_log_prob", "transition_mean_std",
]
