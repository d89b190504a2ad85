"""Rollout data types: what is asked of an engine, what comes back, and the rewards of what came back.
Design notes: docs/design/rollout.md.
"""
from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

SDE_TYPES = ("sde", "cps", "ode")


@dataclass(kw_only=True)
class RolloutRequest:
    """One prompt, sampled ``num_outputs`` times with identical settings and distinct seeds."""

    prompt: str
    """The text prompt."""
    num_outputs: int = 1
    """Group size k: samples drawn for this prompt."""
    seeds: list[int] | None = None
    """One seed per output (len == num_outputs); None derives ``seed + i`` for output i."""
    seed: int = 0
    """Base seed used when ``seeds`` is None."""
    num_steps: int = 10
    """Denoising steps T."""
    guidance_scale: float = 1.0
    """Classifier-free guidance scale; CFG runs only when ``do_cfg`` is True."""
    do_cfg: bool = False
    """Run the unconditional branch (2 DiT forwards per step) with ``negative_prompt``."""
    negative_prompt: str = ""
    """Prompt of the unconditional CFG branch."""
    height: int = 64
    """Image height in pixels."""
    width: int = 64
    """Image width in pixels."""
    num_frames: int | None = None
    """Frames of a video (a video family's card says which counts its VAE takes); None: an image."""
    fps: int | None = None
    """Frames per second of a video (its samples' files); None: an image, or the engine's default."""
    sde_type: str = "sde"
    """Transition: 'sde' (FlowGRPO SDE), 'cps' (coefficient-preserving) or 'ode' (deterministic)."""
    noise_level: float = 0.7
    """Noise level a of the SDE / CPS transition."""
    sde_step_indices: list[int] | None = None
    """Steps sampled stochastically (the SDE window); other steps are ODE with log-prob 0. None = all."""
    log_prob_no_const: bool = False
    """Log-prob without the Gaussian constants: -mean((x' - mu)^2). Required for CPS (sigma' = 0 at the end)."""
    max_sequence_length: int | None = None
    """Prompt length in tokens for every text encoder (SGLang pads each to it); None = the pipeline's default."""
    return_images: bool = True
    """Decode latents to images (needed for rewards; off for pure log-prob checks)."""
    return_model_outputs: bool = False
    """Also return the per-step velocities (``Trajectory.model_outputs``): for parity checks; the trainer
    does not read them, and an SGLang engine computes and ships them only when asked."""
    metadata: dict = field(default_factory=dict)
    """Per-prompt fields for the rewards (e.g. the ``ocr`` reward's ``text``: a ``data.prompts`` .jsonl line's
    fields other than "prompt"); every sample of the group is scored with it. Engines do not read it."""
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """Identifier copied into every Trajectory of this request (the group id)."""

    def __post_init__(self):
        if self.num_outputs < 1:
            raise ValueError(f"num_outputs must be >= 1, got {self.num_outputs}")
        if self.seeds is not None and len(self.seeds) != self.num_outputs:
            raise ValueError(f"seeds has {len(self.seeds)} entries, num_outputs is {self.num_outputs}")
        if self.sde_type not in SDE_TYPES:
            raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {self.sde_type!r}")
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.num_frames is not None and self.num_frames < 1 or self.fps is not None and self.fps < 1:
            raise ValueError(f"num_frames and fps must be >= 1 or None, got {self.num_frames}, {self.fps}")
        if self.sde_step_indices is not None:
            bad = [i for i in self.sde_step_indices if not 0 <= i < self.num_steps]
            if bad:
                raise ValueError(f"sde_step_indices {bad} outside [0, {self.num_steps})")
        if self.do_cfg and self.guidance_scale <= 1.0:
            raise ValueError(f"do_cfg needs guidance_scale > 1, got {self.guidance_scale}")
        last_is_stochastic = self.sde_step_indices is None or self.num_steps - 1 in self.sde_step_indices
        if self.sde_type == "cps" and not self.log_prob_no_const and last_is_stochastic:
            raise ValueError("sde_type='cps' with log-prob constants is NaN at the last step (sigma'=0): "
                             "set log_prob_no_const=True or keep the last step out of sde_step_indices")

    def trajectory_fields(self) -> dict:
        """What every Trajectory of this request copies from it (the group id, the prompt, the sampling settings and
        the image size, and a video's frames); an engine adds the sampled tensors, the output index and seed, and its log-prob convention."""
        return dict(request_id=self.request_id, prompt=self.prompt, sde_type=self.sde_type, noise_level=self.noise_level,
                    guidance_scale=self.guidance_scale, do_cfg=self.do_cfg, height=self.height, width=self.width,
                    num_frames=self.num_frames, fps=self.fps)

    def output_seeds(self) -> list[int]:
        """The seed of every output, in order."""
        return list(self.seeds) if self.seeds is not None else [self.seed + i for i in range(self.num_outputs)]

    def sde_mask(self) -> torch.Tensor:
        """Bool [T]: True where the step is stochastic (has a log-prob), False for ODE steps."""
        if self.sde_type == "ode":
            return torch.zeros(self.num_steps, dtype=torch.bool)
        if self.sde_step_indices is None:
            return torch.ones(self.num_steps, dtype=torch.bool)
        mask = torch.zeros(self.num_steps, dtype=torch.bool)
        mask[list(self.sde_step_indices)] = True
        return mask


@dataclass(kw_only=True)
class Trajectory:
    """One sample of one request. Shapes: T steps; a latent as the DiT consumes it ([C, h, w] for SD3,
    packed [tokens, 4C] for FLUX, [C, f, h, w] for a video: its latent frames f on their own axis)."""

    request_id: str
    """The request (group) this sample belongs to."""
    index: int
    """Position of this sample in its group (0 .. num_outputs-1)."""
    prompt: str
    seed: int
    latents: torch.Tensor
    """[T+1, *latent] float32 ([T+1, C, h, w]; a video [T+1, C, f, h, w]): latents[0] = initial noise, latents[t+1] = sample after step t."""
    sigmas: torch.Tensor
    """[T+1] float32: the (shifted) sigma grid, sigmas[T] == 0."""
    log_probs: torch.Tensor
    """[T] float32: engine log-prob of latents[t+1] given latents[t] (per-element mean; 0 on ODE steps)."""
    sde_mask: torch.Tensor
    """[T] bool: steps that were stochastic."""
    sde_type: str
    noise_level: float
    log_prob_no_const: bool
    guidance_scale: float
    do_cfg: bool
    conditioning: dict[str, torch.Tensor]
    """DiT kwargs to replay a step, per sample, no batch dim: 'encoder_hidden_states' [L, D] and
    'pooled_projections' [P] (plus 'negative_*' twins when do_cfg); FLUX adds 'guidance' (scalar, the
    engine's own units: 1000 x guidance_scale; the trainer reads ``guidance_scale``)."""
    height: int | None = None
    """Image height in pixels of the request that produced this sample (None when not recorded)."""
    width: int | None = None
    """Image width in pixels of the request that produced this sample (None when not recorded)."""
    num_frames: int | None = None
    """Frames of a video sample (``RolloutRequest.num_frames``); None: an image."""
    fps: int | None = None
    """Frames per second of a video sample (``RolloutRequest.fps``); None: an image or the engine's default."""
    model_outputs: torch.Tensor | None = None
    """[T, *latent] float32 velocity used at each step (after CFG) when the request asked for it
    (``RolloutRequest.return_model_outputs``), else None."""
    image: torch.Tensor | None = None
    """[3, H, W] float32 in [0, 1] (a video: [F, 3, H, W], F = ``num_frames``), or None when images were not
    requested."""
    engine_id: str = ""
    """Which engine produced this sample."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per phase (e.g. 'total' for the request that produced this sample)."""

    @property
    def num_steps(self) -> int:
        return int(self.log_probs.shape[0])


@dataclass(frozen=True, kw_only=True)
class RewardScores:
    """Scores of one batch; NaN marks a masked sample."""

    total: torch.Tensor  # [B] weighted sum
    components: dict[str, torch.Tensor]  # label -> [B] raw (unweighted) reward
    weights: dict[str, float]
    seconds: dict[str, float]  # label -> wall time of that component on this batch
    info: dict[str, float] = field(default_factory=dict)  # "<label>/<key>" -> a reward's reported mean
    timeouts: dict[str, int] = field(default_factory=dict)  # label -> batches masked for running past timeout_s

    @classmethod
    def concat(cls, parts: Sequence[RewardScores]) -> RewardScores:
        """The scores of consecutive batches as one: tensors concatenated in order, seconds and timeouts summed,
        info averaged over the batches that report it, weighted by their sizes."""
        if not parts:
            raise ValueError("concat needs at least one RewardScores")
        labels = list(parts[0].components)
        info = {k: _weighted_mean([(p.info[k], len(p.total)) for p in parts if k in p.info])
                for k in dict.fromkeys(k for p in parts for k in p.info)}
        return cls(total=torch.cat([p.total for p in parts]),
                   components={k: torch.cat([p.components[k] for p in parts]) for k in labels},
                   weights=dict(parts[0].weights), seconds={k: sum(p.seconds[k] for p in parts) for k in labels},
                   info=info, timeouts={k: sum(p.timeouts.get(k, 0) for p in parts) for k in labels})

    @property
    def valid(self) -> torch.Tensor:
        """Bool [B]: samples every component scored."""
        return torch.isfinite(self.total)

    def summary(self) -> dict[str, float]:
        """JSON-able means over valid samples (NaN-free), for logging."""
        finite = self.total[torch.isfinite(self.total)]
        out = {"reward/total": _nanmean(self.total), "reward/masked_frac": float((~self.valid).float().mean()),
               "reward/total_std": float(finite.std(unbiased=False)) if finite.numel() else float("nan")}
        for label, v in self.components.items():
            out[f"reward/{label}"] = _nanmean(v)
            out[f"reward/{label}_seconds"] = self.seconds[label]
            out[f"reward/{label}_timeouts"] = float(self.timeouts.get(label, 0))
        out.update({f"reward/{key}": value for key, value in self.info.items()})
        return out


def _weighted_mean(pairs: Sequence[tuple[float, int]]) -> float:
    """The mean of the finite values, weighted (NaN when none is finite)."""
    finite = [(v, w) for v, w in pairs if math.isfinite(v)]
    return sum(v * w for v, w in finite) / sum(w for _, w in finite) if finite else float("nan")


def _nanmean(t: torch.Tensor) -> float:
    finite = t[torch.isfinite(t)]
    return float(finite.mean()) if finite.numel() else float("nan")
