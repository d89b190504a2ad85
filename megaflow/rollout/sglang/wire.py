"""The wire format between megaflow and SGLang: ``RolloutRequest`` -> SGLang request, answer -> ``Trajectory``."""
from __future__ import annotations

import torch
from sglang.multimodal_gen.configs.sample.sampling_params import SamplingParams
from sglang.multimodal_gen.runtime.entrypoints.utils import prepare_request

from megaflow.families import card
from megaflow.rollout.types import RolloutRequest, Trajectory


class EngineCallFailed(RuntimeError):
    """The engine answered a call with an error (a bad request, not a crash)."""


def generator_device() -> str:
    """Where the request's seeded generators live: the engine's device (see docs/design/rollout.md)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_request(server_args, family: str, requests: list[RolloutRequest], *, log_request: bool):
    """One SGLang generation request for ``requests``: merged ones become a prompt list with one seed per
    sample; the per-step velocities (SGLang's rollout debug mode) only when a request asks for them."""
    r0 = requests[0]
    seeds = [s for r in requests for s in r.output_seeds()]
    merged = len(requests) > 1
    sde_type = r0.sde_type
    kwargs = dict(
        prompt=r0.prompt, seed=seeds[0] if (merged or len(seeds) == 1) else seeds,
        num_outputs_per_prompt=1 if merged else r0.num_outputs, num_inference_steps=r0.num_steps,
        height=r0.height, width=r0.width,
        guidance_scale=r0.guidance_scale if (r0.do_cfg or card(family).embedded_guidance) else 1.0,
        generator_device=generator_device(), rollout=True, rollout_sde_type=sde_type,
        rollout_noise_level=r0.noise_level,
        rollout_log_prob_no_const=r0.log_prob_no_const or sde_type == "ode",  # SGLang asserts it for ODE
        rollout_sde_step_indices=list(r0.sde_step_indices) if r0.sde_step_indices is not None else None,
        rollout_return_dit_trajectory=True, rollout_return_denoising_env=True,
        rollout_debug_mode=any(r.return_model_outputs for r in requests), save_output=False,
        suppress_logs=not log_request)
    if r0.do_cfg:
        kwargs["negative_prompt"] = r0.negative_prompt
    if r0.max_sequence_length is not None:
        kwargs["max_sequence_length"] = r0.max_sequence_length
    if r0.num_frames is not None:  # a video (else SGLang's image default); merged requests share it
        kwargs.update(num_frames=r0.num_frames, adjust_frames=False)
        if r0.fps is not None:
            kwargs["fps"] = r0.fps
    sampling = SamplingParams.from_user_sampling_params_args(
        server_args.model_path, server_args=server_args, **kwargs)
    req = prepare_request(server_args=server_args, sampling_params=sampling)
    if merged:  # the scheduler's own merge format: one prompt and one seed per sample
        assert not r0.do_cfg, "CFG requests are never merged"
        req.prompt = [r.prompt for r in requests for _ in range(r.num_outputs)]
        req.extra = dict(req.extra, dynamic_batch_seeds=seeds)
    return req


def _rows(kwargs: dict | None, batch: int, index: int, prefix: str = "") -> dict[str, torch.Tensor]:
    """Sample ``index``'s slice of batched DiT kwargs (dim 0 == batch, or 1 = shared by all samples); a list of
    one tensor (the per-encoder prompt embeddings of a one-encoder pipeline, Qwen-Image's) counts as that tensor."""
    out = {}
    for name, value in (kwargs or {}).items():
        if isinstance(value, (list, tuple)) and len(value) == 1:
            value = value[0]
        if not isinstance(value, torch.Tensor):
            continue
        if value.dim() >= 1 and value.shape[0] == batch:
            value = value[index]
        elif value.dim() >= 1 and value.shape[0] == 1:
            value = value[0]
        out[prefix + name] = value
    return out


def to_trajectories(requests: list[RolloutRequest], ob) -> list[Trajectory]:
    """Split one engine answer (a batch of B samples) into per-sample Trajectories."""
    rtd = ob.rollout_trajectory_data
    if rtd is None or rtd.dit_trajectory is None or rtd.rollout_log_probs is None:
        raise EngineCallFailed("engine returned no rollout data (is SGLang's native pipeline in use? "
                               "check model_id/backend)")
    latents = rtd.dit_trajectory.latents.float()
    sigmas = rtd.dit_trajectory.sigmas.float()
    log_probs = rtd.rollout_log_probs.float()
    debug = rtd.rollout_debug_tensors
    model_outputs = debug.rollout_model_outputs.float() if debug is not None else None
    images = ob.output
    env = rtd.denoising_env
    batch = latents.shape[0]
    expected = sum(r.num_outputs for r in requests)
    assert batch == expected == log_probs.shape[0], (batch, expected, tuple(log_probs.shape))
    out, b = [], 0
    for r in requests:
        for j, seed in enumerate(r.output_seeds()):
            cond = {}
            if env is not None:
                cond.update(_rows(env.image_kwargs, batch, b))
                cond.update(_rows(env.pos_cond_kwargs, batch, b))
                cond.update(_rows(env.neg_cond_kwargs, batch, b, prefix="negative_"))
                if isinstance(env.guidance, torch.Tensor):
                    cond.update(_rows({"guidance": env.guidance}, batch, b))
            out.append(Trajectory(
                **r.trajectory_fields(), index=j, seed=seed, latents=latents[b], sigmas=sigmas, log_probs=log_probs[b],
                sde_mask=r.sde_mask(), log_prob_no_const=r.log_prob_no_const or r.sde_type == "ode", conditioning=cond,
                model_outputs=model_outputs[b] if (r.return_model_outputs and model_outputs is not None) else None,
                image=_sample_image(images[b], r) if (r.return_images and images is not None) else None))
            b += 1
    return out


def _sample_image(output: torch.Tensor, request: RolloutRequest) -> torch.Tensor:
    """A sample's decoded output as megaflow's: an image [3, H, W] (a one-frame axis [3, 1, H, W] dropped: Qwen-Image's
    VAE decodes frames); a video [F, 3, H, W] (SGLang's [3, F, H, W])."""
    if request.num_frames is None:
        return (output[:, 0] if output.dim() == 4 and output.shape[1] == 1 else output).float()
    if output.dim() != 4 or output.shape[1] != request.num_frames:
        raise EngineCallFailed(f"engine returned a video of shape {tuple(output.shape)}, expected "
                               f"[3, {request.num_frames}, H, W]")
    return output.float().movedim(0, 1).contiguous()
