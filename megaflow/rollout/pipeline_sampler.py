"""Diffusers' own sampling of an SD3 pipeline: an independent reference sampler for evaluations
(``megaflow eval shapes --sampler diffusers``). ODE requests without guidance, one seeded generator per sample,
prompts encoded as SGLang encodes them (diffusers' ``prompt=`` path pads CLIP to 77).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

import torch

from megaflow.rollout.types import RolloutRequest

__all__ = ["PipelineSample", "PipelineSampler"]


@dataclass(frozen=True)
class PipelineSample:
    """One sampled image ([3, H, W] in [0, 1]) with its prompt and seed."""

    prompt: str
    seed: int
    image: torch.Tensor


class PipelineSampler:
    """Samples requests with a loaded diffusers ``StableDiffusion3Pipeline`` (fp32, CPU)."""

    def __init__(self, pipeline, *, text_len: int, batch_size: int = 50):
        if text_len < 1 or batch_size < 1:
            raise ValueError(f"text_len and batch_size must be >= 1, got {text_len}, {batch_size}")
        self.pipe, self.text_len, self.batch_size = pipeline, text_len, batch_size
        self.pipe.set_progress_bar_config(disable=True)

    @classmethod
    def from_pretrained(cls, pipeline_dir: str, *, text_len: int | None = None,
                        trust_remote_code: bool = False) -> PipelineSampler:
        """The pipeline of ``pipeline_dir``; prompts of ``text_len`` tokens (default: the pipeline's declared
        length, else 77). A directory naming code (diffusers imports a custom component's module from a local
        directory unasked) is refused unless ``trust_remote_code``."""
        from megaflow.config.remote_code import refuse_remote_code
        refuse_remote_code(pipeline_dir, "pipeline", trust=trust_remote_code)
        import json

        from diffusers import StableDiffusion3Pipeline

        from megaflow.models.pipeline_meta import declared_text_len
        kind = json.loads((Path(pipeline_dir) / "model_index.json").read_text()).get("_class_name")
        if kind != "StableDiffusion3Pipeline":
            raise ValueError(f"pipeline: {pipeline_dir} is a {kind}; the diffusers sampler runs "
                             "StableDiffusion3Pipeline only (use the SGLang engine)")
        pipe = StableDiffusion3Pipeline.from_pretrained(pipeline_dir, torch_dtype=torch.float32)
        return cls(pipe, text_len=text_len or declared_text_len(pipeline_dir) or 77)

    def generate(self, requests: Sequence[RolloutRequest]) -> list[PipelineSample]:
        """Every output of every request, in request order; ValueError for a request this sampler cannot run
        (SDE, guidance, or a prompt length other than its own)."""
        for r in requests:
            if r.sde_type != "ode" or r.do_cfg:
                raise ValueError(f"request {r.request_id}: the diffusers pipeline sampler runs ODE requests "
                                 f"without guidance, got sde_type={r.sde_type!r}, do_cfg={r.do_cfg}")
            if r.max_sequence_length not in (None, self.text_len):
                raise ValueError(f"request {r.request_id}: prompt length {r.max_sequence_length}, the sampler "
                                 f"encodes {self.text_len} tokens")
        samples = [(r, seed) for r in requests for seed in r.output_seeds()]
        out: list[PipelineSample] = []
        # one pipeline call shares steps and size: consecutive samples that agree, batch_size at a time
        for (steps, height, width), run in groupby(samples, key=lambda s: (s[0].num_steps, s[0].height, s[0].width)):
            run = list(run)
            for lo in range(0, len(run), self.batch_size):
                out += self._sample(run[lo:lo + self.batch_size], steps, height, width)
        return out

    @torch.inference_mode()
    def _sample(self, chunk: list[tuple[RolloutRequest, int]], steps: int, height: int,
                width: int) -> list[PipelineSample]:
        from megaflow.models.sd3.text import encode_prompts
        prompts = [r.prompt for r, _ in chunk]
        embeds, pooled = encode_prompts(self.pipe, prompts, max_sequence_length=self.text_len)
        generators = [torch.Generator().manual_seed(int(seed)) for _, seed in chunk]
        images = self.pipe(prompt_embeds=embeds, pooled_prompt_embeds=pooled, num_inference_steps=steps,
                           guidance_scale=1.0, height=height, width=width, generator=generators,
                           output_type="pt").images
        return [PipelineSample(p, int(seed), im.float()) for p, (_, seed), im in zip(prompts, chunk, images)]

    def shutdown(self) -> None:
        """Nothing to stop (the pipeline lives in this process)."""
