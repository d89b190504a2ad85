"""A family's ShapeEval pipeline, as ``megaflow pretrain`` builds, trains and saves it. Invariant: nothing here
asks which family it is; the family's ``shapes`` module (``ModelFamily.shapes``) answers, keeping this contract:

- ``PIPELINE_CLASS``, ``META`` (what ``megaflow.json`` declares), ``DESCRIPTION`` (RECIPE.md's), ``SPATIAL_FACTOR``,
  ``FRAMES`` (None: an image kit trained and evaluated on image ShapeEval; a clip length: a video kit on video
  ShapeEval, its pixels [B, 3, F, H, W] and its ``decode`` clips [B, F, 3, H, W]; ``megaflow.pretrain.bench``);
- text: ``text_components(seed=)``, ``trained_encoders(text)`` -> [(tokenizer, encoder)] the grammar objective
  trains, ``finish_text(text)``, ``word_positions(tokenizer, prompt)``, ``text_features(encoder, tokenizer,
  prompts)`` -> (per-token states [N, L, H], pooled [N, P]);
- VAE: ``make_vae(seed=)``, ``vae_posterior(vae, pixels)``, ``vae_reconstruct(vae, z)``, ``set_latent_stats(vae,
  z)``, ``encode(vae, pixels)`` -> the DiT's latents, ``decode(vae, latents)`` -> images (or clips) in [0, 1],
  ``latent_shape(n, resolution)`` (a video kit's with its latent frame axis);
- DiT and pipeline: ``transformer_config(resolution=, num_layers=, num_heads=, head_dim=)``, ``resolution_of``,
  ``assemble(text=, vae=, transformer_config=, transformer_state=, seed=)``, ``load_parts(path)``,
  ``after_save(directory)``, ``conditioning(pipe, prompts)`` -> {model input: [N, ...]}, ``constant_inputs
  (resolution)``, ``sample_sigmas(pipe, num_steps, image_tokens)``.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import ModuleType


def family_kit(family: str) -> ModuleType:
    """The ``shapes`` module of ``family``; ValueError naming the family when it has none."""
    from megaflow.models.registry import get_family

    kit = get_family(family).shapes
    if kit is None:
        raise ValueError(f"model.family = {family!r}: megaflow pretrain has no ShapeEval pipeline for this family")
    return kit


def save_pipeline(kit: ModuleType, pipe, out: Path, *, extra_files: dict[str, str] | None = None) -> Path:
    """Save ``pipe`` atomically (write a sibling temp dir, let the family add what its engine needs, then replace
    ``out``), with ``extra_files`` beside it."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    kit.after_save(tmp)
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    old = out.with_name(f".{out.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def meta_text(kit: ModuleType, pretrain: dict) -> str:
    """``megaflow.json`` of a pretrained pipeline: the family's declarations and the pretraining record."""
    return json.dumps({**kit.META, "pretrain": pretrain}, indent=2)
