"""A reference sampler: diffusers' SD3 DiT forward + megaflow's flow math, for parity checks.
``ReferenceSampler`` must reproduce the engine's trajectory and log-probs (tests: 1e-5 in fp32); deliberately
plain. Design notes: docs/design/testing.md.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from megaflow.flow.step import TransitionConfig, config_for_step, sigma_max_of, step, transition_mean_std
from megaflow.rollout.types import Trajectory

_DIT_KEYS = ("encoder_hidden_states", "pooled_projections")


@dataclass(kw_only=True)
class ReferenceResult:
    """A batch of sampled trajectories: latents [B, T+1, ...], log_probs [B, T], model_outputs [B, T, ...]."""

    latents: torch.Tensor
    log_probs: torch.Tensor
    model_outputs: torch.Tensor


def transition_config(t: Trajectory) -> TransitionConfig:
    """The megaflow transition of a trajectory's stochastic steps."""
    return TransitionConfig(kind=t.sde_type, noise_level=t.noise_level, no_const=t.log_prob_no_const)


def sde_step_indices(t: Trajectory) -> list[int] | None:
    """The SDE window of a trajectory as step indices (None = every step)."""
    return None if bool(t.sde_mask.all()) else [int(i) for i in torch.nonzero(t.sde_mask).flatten()]


def noises_from_trajectory(t: Trajectory) -> torch.Tensor:
    """ε [T, ...] with x_{t+1} = μ_t + std_t·ε_t, from the trajectory's latents and engine velocities (0 on ODE steps)."""
    if t.model_outputs is None:
        raise ValueError(f"trajectory {t.request_id}/{t.index} has no model_outputs "
                         "(ask with RolloutRequest.return_model_outputs)")
    config, window = transition_config(t), sde_step_indices(t)
    sigmas, sigma_max = t.sigmas, sigma_max_of(t.sigmas)
    noises = torch.zeros_like(t.latents[1:])
    for i in range(t.num_steps):
        cfg = config_for_step(config, i, window)
        if cfg.kind == "ode":
            continue
        x, v = t.latents[i : i + 1], t.model_outputs[i : i + 1]
        mean, std, _ = transition_mean_std(x, v, sigmas[i], sigmas[i + 1], sigma_max=sigma_max, config=cfg)
        noises[i] = ((t.latents[i + 1 : i + 2] - mean) / std)[0]
    return noises


class ReferenceSampler:
    """The SD3 DiT of a diffusers pipeline directory, sampled with megaflow.flow.step."""

    def __init__(self, pipeline_dir: str | Path, *, dtype: torch.dtype = torch.float32):
        from diffusers import SD3Transformer2DModel

        self.pipeline_dir = Path(pipeline_dir)
        self.transformer = SD3Transformer2DModel.from_pretrained(self.pipeline_dir / "transformer",
                                                                 torch_dtype=dtype).eval()
        scheduler_config = json.loads((self.pipeline_dir / "scheduler" / "scheduler_config.json").read_text())
        self.num_train_timesteps = int(scheduler_config.get("num_train_timesteps", 1000))

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load DiT weights by diffusers names (e.g. the tensors pushed to an engine)."""
        self.transformer.load_state_dict(state_dict, strict=False)

    @torch.no_grad()
    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor], *,
                 do_cfg: bool, guidance_scale: float) -> torch.Tensor:
        """DiT velocity at σ (timestep σ·num_train_timesteps), with classifier-free guidance when do_cfg."""
        dtype = self.transformer.dtype
        timestep = (sigma * self.num_train_timesteps).to(torch.float32).expand(x.shape[0])
        kwargs = {k: cond[k].to(dtype) for k in _DIT_KEYS}
        v = self.transformer(hidden_states=x.to(dtype), timestep=timestep, return_dict=False, **kwargs)[0]
        if do_cfg:
            neg = {k: cond[f"negative_{k}"].to(dtype) for k in _DIT_KEYS}
            v_uncond = self.transformer(hidden_states=x.to(dtype), timestep=timestep, return_dict=False, **neg)[0]
            v = v_uncond + guidance_scale * (v - v_uncond)
        return v.float()

    @torch.no_grad()
    def sample(self, *, initial_noise: torch.Tensor, sigmas: torch.Tensor, conditioning: dict[str, torch.Tensor],
               config: TransitionConfig, noises: torch.Tensor, sde_step_indices: Sequence[int] | None = None,
               do_cfg: bool = False, guidance_scale: float = 1.0) -> ReferenceResult:
        """Run T steps from ``initial_noise`` [B, ...] with step noise ``noises`` [B, T, ...] and batched conditioning."""
        x = initial_noise.float()
        sigma_max = sigma_max_of(sigmas)
        latents, log_probs, velocities = [x], [], []
        for i in range(sigmas.shape[0] - 1):
            v = self.velocity(x, sigmas[i], conditioning, do_cfg=do_cfg, guidance_scale=guidance_scale)
            cfg = config_for_step(config, i, sde_step_indices)
            out = step(x, v, sigmas[i], sigmas[i + 1], sigma_max=sigma_max, config=cfg,
                       noise=None if cfg.kind == "ode" else noises[:, i])
            x = out.sample
            latents.append(x)
            log_probs.append(out.log_prob)
            velocities.append(v)
        return ReferenceResult(latents=torch.stack(latents, 1), log_probs=torch.stack(log_probs, 1),
                               model_outputs=torch.stack(velocities, 1))

    def replay(self, trajectories: Sequence[Trajectory]) -> ReferenceResult:
        """Re-run engine trajectories (same sampling settings) with the engine's noise and conditioning."""
        t0 = trajectories[0]
        for t in trajectories[1:]:
            same = (t.sde_type, t.noise_level, t.log_prob_no_const, t.do_cfg, t.guidance_scale,
                    tuple(t.sde_mask.tolist())) == (t0.sde_type, t0.noise_level, t0.log_prob_no_const, t0.do_cfg,
                                                    t0.guidance_scale, tuple(t0.sde_mask.tolist()))
            if not same or not torch.equal(t.sigmas, t0.sigmas):
                raise ValueError("replay needs trajectories with identical sampling settings and sigmas")
        cond_keys = [k for k in t0.conditioning if k.removeprefix("negative_") in _DIT_KEYS]
        conditioning = {k: torch.stack([t.conditioning[k] for t in trajectories]) for k in cond_keys}
        return self.sample(initial_noise=torch.stack([t.latents[0] for t in trajectories]), sigmas=t0.sigmas,
                           conditioning=conditioning, config=transition_config(t0),
                           noises=torch.stack([noises_from_trajectory(t) for t in trajectories]),
                           sde_step_indices=sde_step_indices(t0), do_cfg=t0.do_cfg,
                           guidance_scale=t0.guidance_scale)

    def encode_prompt(self, prompt: str, *, negative_prompt: str = "", do_cfg: bool = False,
                      max_sequence_length: int = 256) -> dict[str, torch.Tensor]:
        """diffusers' SD3 text conditioning of one prompt (no batch dim), keyed like Trajectory.conditioning."""
        from diffusers import StableDiffusion3Pipeline

        from megaflow.config.remote_code import refuse_remote_code
        refuse_remote_code(self.pipeline_dir, "pipeline")
        pipe = StableDiffusion3Pipeline.from_pretrained(self.pipeline_dir, transformer=None, vae=None,
                                                        torch_dtype=torch.float32)
        with torch.no_grad():
            pe, npe, pooled, npooled = pipe.encode_prompt(
                prompt=prompt, prompt_2=None, prompt_3=None, negative_prompt=negative_prompt if do_cfg else None,
                do_classifier_free_guidance=do_cfg, max_sequence_length=max_sequence_length)
        out = {"encoder_hidden_states": pe[0], "pooled_projections": pooled[0]}
        if do_cfg:
            out.update(negative_encoder_hidden_states=npe[0], negative_pooled_projections=npooled[0])
        return out
