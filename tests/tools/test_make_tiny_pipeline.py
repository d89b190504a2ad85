"""tools/make_tiny_pipeline.py (needs: CPU 1 proc, ~15 s): offline, seeded, small, loadable by diffusers.

Loading by SGLang's native pipeline is covered by tests/rollout/test_sglang_engine.py (SD3),
tests/rollout/test_sglang_engine_flux.py (FLUX), tests/rollout/test_sglang_engine_wan.py (Wan) and
tests/rollout/test_sglang_engine_qwen_image.py (Qwen-Image).
"""
from __future__ import annotations

import hashlib

import pytest
import torch


def _digest(directory) -> dict[str, str]:
    return {str(f.relative_to(directory)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(directory.rglob("*.safetensors"))}


@pytest.mark.parametrize("family,pipeline_class", [("sd3", "StableDiffusion3Pipeline"), ("flux", "FluxPipeline"),
                                                   ("qwen_image", "QwenImagePipeline")])
def test_tiny_pipeline_is_small_seeded_and_loads(tiny_pipeline_tool, tmp_path, family, pipeline_class):
    from diffusers import DiffusionPipeline

    torch.set_num_threads(1)
    a = tiny_pipeline_tool.make_tiny_pipeline(family, tmp_path / "a", seed=1)
    b = tiny_pipeline_tool.make_tiny_pipeline(family, tmp_path / "b", seed=1)
    assert _digest(a) == _digest(b)  # same seed, same bytes
    assert sum(f.stat().st_size for f in a.rglob("*") if f.is_file()) < 5 * 2**20

    pipe = DiffusionPipeline.from_pretrained(a, torch_dtype=torch.float32)  # plain diffusers picks the class
    assert type(pipe).__name__ == pipeline_class
    other = tiny_pipeline_tool.BUILDERS[family](seed=2)
    assert not torch.equal(next(pipe.transformer.parameters()), next(other.transformer.parameters()))
    tokenizers = [getattr(pipe, n) for n in ("tokenizer", "tokenizer_2", "tokenizer_3") if hasattr(pipe, n)]
    for tok in tokenizers:  # an empty tokenizer (len 2-3) would silently encode every prompt the same
        assert len(tok) > 50
        assert tok("a red cat").input_ids != tok("a blue dog").input_ids
    cfg = dict(true_cfg_scale=4.0, negative_prompt="blue") if pipeline_class == "QwenImagePipeline" else {}
    images = pipe("a red cat", num_inference_steps=2, height=64, width=64, output_type="pt",
                  generator=torch.Generator().manual_seed(0), **cfg).images
    assert images.shape == (1, 3, 64, 64) and torch.isfinite(images).all()


def test_unknown_family_is_rejected(tiny_pipeline_tool, tmp_path):
    with pytest.raises(ValueError, match="family"):
        tiny_pipeline_tool.make_tiny_pipeline("sdxl", tmp_path)


def test_tiny_wan_pipeline_is_seeded_and_samples_a_clip(tiny_pipeline_tool, tmp_path):
    """The tiny Wan 2.1 T2V pipeline loads in diffusers' WanPipeline and samples a 5-frame clip: frames on their own
    axis, the VAE's 4x temporal / 8x spatial compression ((5 - 1) / 4 + 1 = 2 latent frames of 8 x 8)."""
    from diffusers import WanPipeline

    torch.set_num_threads(1)
    a = tiny_pipeline_tool.make_tiny_pipeline("wan", tmp_path / "a", seed=1)
    b = tiny_pipeline_tool.make_tiny_pipeline("wan", tmp_path / "b", seed=1)
    assert _digest(a) == _digest(b)
    assert sum(f.stat().st_size for f in a.rglob("*") if f.is_file()) < 5 * 2**20
    pipe = WanPipeline.from_pretrained(a, torch_dtype=torch.float32)
    other = tiny_pipeline_tool.build_wan(seed=2)
    assert not torch.equal(next(pipe.transformer.parameters()), next(other.transformer.parameters()))
    assert len(pipe.tokenizer) > 50 and pipe.tokenizer("a red cat").input_ids != pipe.tokenizer("a blue dog").input_ids
    call = dict(prompt="a red cat", num_frames=5, height=64, width=64, num_inference_steps=2, guidance_scale=1.0)
    latents = pipe(**call, output_type="latent", generator=torch.Generator().manual_seed(0)).frames
    assert latents.shape == (1, 16, 2, 8, 8)
    video = pipe(**call, output_type="pt", generator=torch.Generator().manual_seed(0)).frames
    assert video.shape == (1, 5, 3, 64, 64) and torch.isfinite(video).all()
    assert 0 <= video.min() and video.max() <= 1 and video.std() > 0
