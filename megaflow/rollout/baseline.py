"""A plain single-process diffusers sampling loop with FlowGRPO log-probs: the rollout baseline.
``DiffusersEngine`` samples every request of a ``generate`` call in ONE batched loop, transitions and log-probs
from ``megaflow.flow.step``. Design notes: docs/design/rollout.md.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from megaflow.bridge.target import ModuleTarget
from megaflow.flow.schedule import sd3_sigmas
from megaflow.flow.step import TransitionConfig, config_for_step, sigma_max_of, step
from megaflow.bridge.base import WeightUpdateResult
from megaflow.checksum import DEFAULT
from megaflow.rollout.engine import EngineHealth
from megaflow.rollout.types import RolloutRequest, Trajectory

__all__ = ["DiffusersEngine", "DiffusersEngineConfig"]


@dataclass(kw_only=True)
class DiffusersEngineConfig:
    """How the baseline loop loads and batches."""

    engine_id: str = "diffusers"
    """Name reported in trajectories, health and metrics."""
    max_batch_size: int = 0
    """Most samples per DiT forward; 0 = all samples of one ``generate`` call in one batch."""
    max_sequence_length: int = 256
    """T5 tokens per prompt (diffusers' SD3 default; the text length sets the DiT's joint sequence)."""

    def __post_init__(self):
        if self.max_batch_size < 0:
            raise ValueError(f"max_batch_size must be >= 0, got {self.max_batch_size}")
        if self.max_sequence_length < 1:
            raise ValueError(f"max_sequence_length must be >= 1, got {self.max_sequence_length}")



def _batch_key(r: RolloutRequest) -> tuple:
    """Requests with equal keys share one denoising loop (same grid, shapes and transition)."""
    window = tuple(r.sde_step_indices) if r.sde_step_indices is not None else None
    return (r.num_steps, r.height, r.width, r.sde_type, r.noise_level, window, r.log_prob_no_const,
            r.do_cfg, r.guidance_scale if r.do_cfg else 1.0, r.return_images, r.max_sequence_length)


class DiffusersEngine:
    """Batched SD3 rollouts with diffusers modules and ``megaflow.flow`` steps (see the module's design notes)."""

    def __init__(self, pipeline, *, config: DiffusersEngineConfig | None = None):
        """Wrap a loaded diffusers ``StableDiffusion3Pipeline`` (fp32, CPU)."""
        config = config or DiffusersEngineConfig()
        self.config = config
        self.engine_id = config.engine_id
        self.pipe = pipeline
        self.transformer = pipeline.transformer.eval().requires_grad_(False)
        self.vae = pipeline.vae.eval().requires_grad_(False)
        self._lock = threading.Lock()  # one generate / weight update at a time (modules are shared state)
        self._closed = False
        scheduler_cfg = pipeline.scheduler.config
        if scheduler_cfg.get("use_dynamic_shifting", False):
            raise ValueError("scheduler uses dynamic shifting: the baseline supports SD3's static shift only")
        self._shift = float(scheduler_cfg.get("shift", 1.0))
        self._num_train_timesteps = int(scheduler_cfg.get("num_train_timesteps", 1000))
        self.text_len: int | None = None
        """Prompt length the pipeline declares (megaflow.json; set by ``from_pretrained``): the default of
        requests without ``max_sequence_length``."""

    @classmethod
    def from_pretrained(cls, pipeline_dir: str, *, config: DiffusersEngineConfig | None = None) -> DiffusersEngine:
        """Load the fp32 SD3 pipeline of ``pipeline_dir`` (model_index.json + components) on CPU; a directory
        naming code is refused (megaflow.config.remote_code)."""
        from megaflow.config.remote_code import refuse_remote_code
        refuse_remote_code(pipeline_dir, "pipeline")
        from diffusers import StableDiffusion3Pipeline

        from megaflow.models.pipeline_meta import declared_text_len

        pipe = StableDiffusion3Pipeline.from_pretrained(pipeline_dir, torch_dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        engine = cls(pipe, config=config)
        engine.text_len = declared_text_len(pipeline_dir)
        return engine

    # ---------------------------------------------------------------- sampling
    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        """Sample every request; compatible requests share one batched loop. Request order, then index."""
        if self._closed:
            raise RuntimeError(f"engine {self.engine_id} is shut down")
        by_key: dict[tuple, list[int]] = {}
        for i, r in enumerate(requests):
            by_key.setdefault(_batch_key(r), []).append(i)
        out: list[list[Trajectory]] = [[] for _ in requests]
        with self._lock, torch.inference_mode():
            for indices in by_key.values():
                for i, trajs in zip(indices, self._sample_compatible([requests[i] for i in indices])):
                    out[i] = trajs
        return [t for trajs in out for t in trajs]

    def submit(self, requests: Sequence[RolloutRequest]) -> list[Future]:
        """``generate`` run to the end in the caller's thread, returned as completed futures (one per
        request): this in-process loop samples everything before anything can be scored."""
        trajs, futures, start = self.generate(requests), [], 0
        for r in requests:
            futures.append(Future())
            futures[-1].set_result(trajs[start:start + r.num_outputs])
            start += r.num_outputs
        return futures

    def _sample_compatible(self, requests: list[RolloutRequest]) -> list[list[Trajectory]]:
        """One loop (chunked by ``max_batch_size``) over all samples of requests with the same batch key."""
        samples = [(ri, j, seed) for ri, r in enumerate(requests) for j, seed in enumerate(r.output_seeds())]
        cap = self.config.max_batch_size or len(samples)
        cond = self._encode(requests)
        trajs: list[list[Trajectory]] = [[] for _ in requests]
        for lo in range(0, len(samples), cap):
            chunk = samples[lo:lo + cap]
            t0 = time.perf_counter()
            rows = torch.tensor([ri for ri, _, _ in chunk])
            chunk_cond = {k: v[rows] for k, v in cond.items()}
            result = self._denoise(requests[0], chunk_cond, [seed for _, _, seed in chunk])
            seconds = time.perf_counter() - t0
            for b, (ri, j, seed) in enumerate(chunk):
                r = requests[ri]
                trajs[ri].append(Trajectory(
                    **r.trajectory_fields(), index=j, seed=seed,
                    latents=result["latents"][b], sigmas=result["sigmas"], log_probs=result["log_probs"][b],
                    sde_mask=r.sde_mask(), log_prob_no_const=r.log_prob_no_const,
                    conditioning={k: v[b] for k, v in chunk_cond.items()},
                    model_outputs=result["model_outputs"][b] if r.return_model_outputs else None,
                    image=result["images"][b] if result["images"] is not None else None,
                    engine_id=self.engine_id, timings={"total": seconds}))
        return trajs

    def _encode(self, requests: list[RolloutRequest]) -> dict[str, torch.Tensor]:
        """Text conditioning, one row per request; padded to the prompt length as SGLang encodes it when there is one,
        else diffusers' ``encode_prompt``."""
        r0 = requests[0]
        seq_len = r0.max_sequence_length or self.text_len
        if seq_len:
            from megaflow.models.sd3.text import encode_prompts
            pe, ppe = encode_prompts(self.pipe, [r.prompt for r in requests], max_sequence_length=seq_len)
            cond = {"encoder_hidden_states": pe, "pooled_projections": ppe}
            if r0.do_cfg:
                npe, nppe = encode_prompts(self.pipe, [r.negative_prompt for r in requests],
                                           max_sequence_length=seq_len)
                cond.update(negative_encoder_hidden_states=npe, negative_pooled_projections=nppe)
            return cond
        pe, npe, ppe, nppe = self.pipe.encode_prompt(
            prompt=[r.prompt for r in requests], prompt_2=None, prompt_3=None, device=torch.device("cpu"),
            num_images_per_prompt=1, do_classifier_free_guidance=r0.do_cfg,
            negative_prompt=[r.negative_prompt for r in requests] if r0.do_cfg else None,
            max_sequence_length=self.config.max_sequence_length)
        cond = {"encoder_hidden_states": pe.float(), "pooled_projections": ppe.float()}
        if r0.do_cfg:
            cond["negative_encoder_hidden_states"] = npe.float()
            cond["negative_pooled_projections"] = nppe.float()
        return cond

    def _velocity(self, x: torch.Tensor, sigma: float, cond: dict[str, torch.Tensor], r: RolloutRequest):
        """DiT velocity for the batch (CFG: one forward over [uncond; cond], then combine)."""
        ehs, pooled = cond["encoder_hidden_states"], cond["pooled_projections"]
        if r.do_cfg:
            x_in = torch.cat([x, x])
            ehs = torch.cat([cond["negative_encoder_hidden_states"], ehs])
            pooled = torch.cat([cond["negative_pooled_projections"], pooled])
        else:
            x_in = x
        timestep = torch.full((x_in.shape[0],), sigma * self._num_train_timesteps, dtype=torch.float32)
        v = self.transformer(hidden_states=x_in, timestep=timestep, encoder_hidden_states=ehs,
                             pooled_projections=pooled, return_dict=False)[0].float()
        if r.do_cfg:
            v_uncond, v_cond = v.chunk(2)
            v = v_uncond + r.guidance_scale * (v_cond - v_uncond)
        return v

    def _denoise(self, r: RolloutRequest, cond: dict[str, torch.Tensor], seeds: list[int]) -> dict:
        """The sampling loop for one batch of samples sharing the settings of ``r``."""
        scale = 2 ** (len(self.vae.config.block_out_channels) - 1)
        shape = (1, self.transformer.config.in_channels, r.height // scale, r.width // scale)
        gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        x = torch.cat([torch.randn(shape, generator=g) for g in gens])
        sigmas = sd3_sigmas(r.num_steps, shift=self._shift, num_train_timesteps=self._num_train_timesteps)
        sigma_max = sigma_max_of(sigmas)
        base = TransitionConfig(kind=r.sde_type, noise_level=r.noise_level, no_const=r.log_prob_no_const)
        latents, log_probs, velocities = [x], [], []
        for i in range(r.num_steps):
            v = self._velocity(x, float(sigmas[i]), cond, r)
            cfg_i = config_for_step(base, i, r.sde_step_indices)
            res = step(x, v, sigmas[i], sigmas[i + 1], sigma_max=sigma_max, config=cfg_i,
                       generator=None if cfg_i.kind == "ode" else gens)
            x = res.sample
            latents.append(x)
            log_probs.append(res.log_prob)
            velocities.append(v)
        images = self._decode(x) if r.return_images else None
        return {"latents": torch.stack(latents, dim=1), "log_probs": torch.stack(log_probs, dim=1),
                "model_outputs": torch.stack(velocities, dim=1), "sigmas": sigmas, "images": images}

    def _decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents -> images [B, 3, H, W] in [0, 1]."""
        vcfg = self.vae.config
        z = x / vcfg.scaling_factor + (vcfg.shift_factor or 0.0)
        image = self.vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    # ---------------------------------------------------------------- weights and control
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> WeightUpdateResult:
        """Copy tensors into the DiT; all-or-nothing: unknown names or shape mismatches load nothing."""
        t0 = time.perf_counter()
        items = list(named_tensors)
        with self._lock:
            result = ModuleTarget(self.transformer, self.engine_id).update_weights(items)
        result.seconds = time.perf_counter() - t0
        return result

    def load_bucket(self, bucket, *, digests: dict[str, str] | None = None, checksum: str = DEFAULT
                    ) -> WeightUpdateResult:
        """One ``megaflow.bridge.buckets.Bucket`` as one all-or-nothing update (every name and shape checked
        first), then, with ``digests``, the DiT tensors re-hashed against them (``ModuleTarget.load_bucket``)."""
        t0 = time.perf_counter()
        with self._lock:
            result = ModuleTarget(self.transformer, self.engine_id).load_bucket(bucket, digests=digests,
                                                                                checksum=checksum)
        result.seconds = time.perf_counter() - t0
        return result

    def verify_weights(self, expected_digests: dict[str, str], *, checksum: str = DEFAULT) -> tuple[bool, str]:
        """Re-hash the named DiT tensors (``megaflow.checksum.tensor_digest``, the bridge's function)."""
        with self._lock:
            return ModuleTarget(self.transformer, self.engine_id).verify_weights(expected_digests, checksum=checksum)

    def update_weights_from_disk(self, path: str) -> WeightUpdateResult:
        """Load the DiT of a pipeline dir (``path/transformer``) or a transformer dir."""
        from pathlib import Path

        from diffusers import SD3Transformer2DModel

        sub = Path(path) / "transformer"
        src = SD3Transformer2DModel.from_pretrained(str(sub if sub.is_dir() else path), torch_dtype=torch.float32)
        return self.update_weights(src.state_dict().items())

    def checksum(self) -> str:
        """``megaflow.checksum.weights_checksum`` over the DiT's state_dict (``ModuleTarget.checksum``)."""
        with self._lock:
            return ModuleTarget(self.transformer, self.engine_id).checksum()

    def release(self) -> None:
        """Nothing to free: the baseline holds its modules on CPU."""

    def resume(self) -> None:
        """Nothing to retake (see ``release``)."""

    def health(self) -> EngineHealth:
        return EngineHealth(alive=not self._closed, engine_id=self.engine_id, detail="in-process diffusers loop")

    def shutdown(self) -> None:
        """Idempotent; later ``generate`` calls raise."""
        self._closed = True
