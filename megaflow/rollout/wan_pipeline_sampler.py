"""Diffusers' own sampling of a Wan 2.1 text-to-video pipeline: an independent reference sampler for video
evaluations (``megaflow eval video --sampler diffusers``). ODE requests without guidance, one seeded generator per
clip, prompts padded to the pipeline's text length as SGLang pads them (WanPipeline's ``max_sequence_length``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

import torch

from megaflow.rollout.types import RolloutRequest

__all__ = ["ClipSample", "WanPipelineSampler"]


@dataclass(frozen=True)
class ClipSample:
    """One sampled clip ([F, 3, H, W] in [0, 1]) with its prompt and seed."""

    prompt: str
    seed: int
    image: torch.Tensor


class WanPipelineSampler:
    """Samples video requests with a loaded diffusers ``WanPipeline`` (fp32, CPU)."""

    def __init__(self, pipeline, *, text_len: int, batch_size: int = 16):
        if text_len < 1 or batch_size < 1:
            raise ValueError(f"text_len and batch_size must be >= 1, got {text_len}, {batch_size}")
        self.pipe, self.text_len, self.batch_size = pipeline, text_len, batch_size
        self.pipe.set_progress_bar_config(disable=True)

    @classmethod
    def from_pretrained(cls, pipeline_dir: str, *, trust_remote_code: bool = False) -> WanPipelineSampler:
        """The pipeline of ``pipeline_dir``, prompts of its declared text length (else Wan's 512 tokens); a directory
        naming code is refused unless ``trust_remote_code``."""
        from megaflow.config.remote_code import refuse_remote_code
        refuse_remote_code(pipeline_dir, "pipeline", trust=trust_remote_code)
        from diffusers import WanPipeline

        from megaflow.families import card
        from megaflow.models.pipeline_meta import declared_text_len
        pipe = WanPipeline.from_pretrained(pipeline_dir, torch_dtype=torch.float32)
        return cls(pipe, text_len=declared_text_len(pipeline_dir) or card("wan").default_text_tokens)

    def generate(self, requests: Sequence[RolloutRequest]) -> list[ClipSample]:
        """Every output of every request, in request order; ValueError for a request this sampler cannot run (SDE,
        guidance, no frame count, or a prompt length other than its own)."""
        for r in requests:
            if r.sde_type != "ode" or r.do_cfg or not r.num_frames:
                raise ValueError(f"request {r.request_id}: the diffusers Wan sampler runs ODE video requests without "
                                 f"guidance, got sde_type={r.sde_type!r}, do_cfg={r.do_cfg}, num_frames={r.num_frames}")
            if r.max_sequence_length not in (None, self.text_len):
                raise ValueError(f"request {r.request_id}: prompt length {r.max_sequence_length}, the sampler "
                                 f"encodes {self.text_len} tokens")
        samples = [(r, seed) for r in requests for seed in r.output_seeds()]
        out: list[ClipSample] = []
        shape = lambda s: (s[0].num_steps, s[0].num_frames, s[0].height, s[0].width)  # noqa: E731
        for key, run in groupby(samples, key=shape):  # one pipeline call shares steps and sizes
            run = list(run)
            for lo in range(0, len(run), self.batch_size):
                out += self._sample(run[lo:lo + self.batch_size], *key)
        return out

    @torch.inference_mode()
    def _sample(self, chunk: list[tuple[RolloutRequest, int]], steps: int, frames: int, height: int,
                width: int) -> list[ClipSample]:
        prompts = [r.prompt for r, _ in chunk]
        generators = [torch.Generator().manual_seed(int(seed)) for _, seed in chunk]
        clips = self.pipe(prompt=prompts, num_inference_steps=steps, guidance_scale=1.0, num_frames=frames,
                          height=height, width=width, generator=generators, output_type="pt",
                          max_sequence_length=self.text_len).frames
        return [ClipSample(p, int(seed), clip.float()) for p, (_, seed), clip in zip(prompts, chunk, clips)]

    def shutdown(self) -> None:
        """Nothing to stop (the pipeline lives in this process)."""
