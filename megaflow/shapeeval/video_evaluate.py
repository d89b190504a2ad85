"""Video ShapeEval of a model: held-out prompts sampled as clips through an engine (SGLang's, or diffusers'
WanPipeline), scored with 95% intervals (rewards per frame are the caller's: ``rewards.frames.score_per_frame``).
Invariant: the prompt set is fixed by (num, seed) and each prompt has its own seed and ODE sampling, as for images.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from megaflow.data.video_shapes import sample_video_prompts
from megaflow.shapeeval import SAMPLERS
from megaflow.shapeeval.video_io import save_clips
from megaflow.shapeeval.video_score import score_clip_batch, summarize_clips


def clips_uint8(clips: torch.Tensor) -> np.ndarray:
    """float clips [N, F, 3, H, W] in [0, 1] as uint8 [N, F, H, W, 3] (the image benchmark's rounding)."""
    return (clips.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 1, 3, 4, 2).numpy()


def clips_float(clips: list[np.ndarray]) -> torch.Tensor:
    """uint8 clips [F, H, W, 3] (all of one shape) as float [N, F, 3, H, W] in [0, 1], the rewards' layout."""
    return torch.from_numpy(np.stack(clips)).permute(0, 1, 4, 2, 3).float() / 255.0


def video_requests(prompts: list[str], *, seed: int, num_steps: int, resolution: int, num_frames: int, fps: int,
                   max_sequence_length: int | None):
    from megaflow.rollout.types import RolloutRequest
    return [RolloutRequest(prompt=p, num_outputs=1, seed=seed * 100_003 + i, num_steps=num_steps, height=resolution,
                           width=resolution, num_frames=num_frames, fps=fps, sde_type="ode",
                           max_sequence_length=max_sequence_length, request_id=f"veval{i}")
            for i, p in enumerate(prompts)]


def evaluate_video_engine(engine, *, num: int = 200, seed: int = 0, num_steps: int = 10, resolution: int = 32,
                          num_frames: int = 5, fps: int = 8, max_sequence_length: int | None = None,
                          split: str = "eval", out_dir: Path | None = None) -> tuple[dict, torch.Tensor, list[str]]:
    """(result, clips [N, F, 3, H, W] in [0, 1], prompts): ``num`` prompts of ``split`` (round-robin over the
    categories) sampled through ``engine`` (ODE) and scored; with ``out_dir`` the clips are saved as PNG-frame folders
    with a manifest (``video_io.save_clips``)."""
    prompts = sample_video_prompts(split, num, seed=seed)
    samples = engine.generate(video_requests(prompts, seed=seed, num_steps=num_steps, resolution=resolution,
                                             num_frames=num_frames, fps=fps, max_sequence_length=max_sequence_length))
    clips = torch.stack([s.image.float() for s in samples])
    if clips.ndim != 5 or clips.shape[1] != num_frames:
        raise RuntimeError(f"the sampler returned {tuple(clips.shape)}, want [N, {num_frames}, 3, H, W] clips")
    arr = clips_uint8(clips)
    result = summarize_clips(score_clip_batch(arr, prompts))
    result.update(seed=seed, num_steps=num_steps, resolution=resolution, num_frames=num_frames, split=split)
    if out_dir is not None:
        save_clips(arr, prompts, Path(out_dir))
        result["clips"] = str(out_dir)
    return result, clips, prompts


def open_sampler(pipeline_dir: Path, sampler: str, *, trust_remote_code: bool = False):
    """The engine that samples ``pipeline_dir``'s clips: one SGLang engine of the Wan family, or diffusers'
    WanPipeline (megaflow.rollout.wan_pipeline_sampler)."""
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler {sampler!r}: expected one of {', '.join(SAMPLERS)}")
    if sampler == "diffusers":
        from megaflow.rollout.wan_pipeline_sampler import WanPipelineSampler
        return WanPipelineSampler.from_pretrained(str(pipeline_dir), trust_remote_code=trust_remote_code)
    from megaflow.rollout.sglang import SGLangEngine, SGLangEngineConfig
    return SGLangEngine(SGLangEngineConfig(model_path=str(pipeline_dir), family="wan",
                                           trust_remote_code=trust_remote_code))


def evaluate_video_pipeline(pipeline_dir: Path, *, sampler: str = "sglang", trust_remote_code: bool = False,
                            **kwargs) -> tuple[dict, torch.Tensor, list[str]]:
    """``evaluate_video_engine`` on a Wan pipeline directory through ``sampler`` (``open_sampler``)."""
    from megaflow.models.pipeline_meta import declared_text_len
    pipeline_dir = Path(pipeline_dir)
    engine = open_sampler(pipeline_dir, sampler, trust_remote_code=trust_remote_code)
    try:
        result, clips, prompts = evaluate_video_engine(engine, max_sequence_length=declared_text_len(pipeline_dir),
                                                       **kwargs)
        return {**result, "sampler": sampler}, clips, prompts
    finally:
        engine.shutdown()


def brief(result: dict) -> dict:
    """The result without per-clip lists (for printing)."""
    out = {k: v for k, v in result.items() if k != "passed"}
    if "rewards" in out:
        out["rewards"] = {k: {kk: vv for kk, vv in v.items() if kk != "scores"} for k, v in out["rewards"].items()}
    return out
