"""``FamilyCard``: what the light rooms (config, plan, rundir, the engines' settings) know of a model family, as
plain data and standard-library functions. Invariant: a card imports nothing but the standard library, so a bad
config is refused before torch loads; the family's torch part (``ModelFamily``) lives in ``card.package``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, kw_only=True, eq=False)
class FamilyCard:
    """One model family's light facts (``megaflow.families.<name>.CARD``)."""

    name: str
    """``model.family``'s value."""
    title: str
    """The family's name in messages ("SD3", "FLUX")."""
    package: str
    """The package whose ``FAMILY`` (``megaflow.models.registry.ModelFamily``) is the torch part."""
    diffusers_class: str
    """``_class_name`` of the pipeline's ``transformer/config.json``."""
    sglang_model_id: str
    """The model id that selects SGLang's native pipeline for the family."""
    text_encoders: int
    """Text encoders of the pipeline (one precision each for the engine)."""
    embedded_guidance: bool
    """True: ``rollout.guidance_scale`` is a model input (FLUX.1-dev's guidance embedding), never classifier-free
    guidance; False: guidance_scale > 1 samples with CFG (negative and positive branches)."""
    latent_pack: int | None
    """Latents per token side whatever the transformer's ``patch_size`` (FLUX packs 2x2 latents into a token and
    has patch_size 1); None: the transformer's ``patch_size``."""
    position_table: bool
    """``pos_embed_max_size`` of the transformer bounds the image side (SD3's position table)."""
    tiny_positions: int | None
    """Positions per side of the tiny pipeline megaflow builds for a run without ``model.pretrained`` (SD3's
    ``pos_embed_max_size``; a video family's rotary table, per frame / row / column axis)."""
    blocks_key: str | None
    """The transformer config key counting every block (checked against the pipeline-parallel split before the
    run); None: the blocks are counted under several keys and the trainer checks the split."""
    builtin: tuple[str, dict]
    """``megaflow plan``'s table when the pipeline is not here: (its name, the published transformer config)."""
    builtin_variants: tuple[tuple[str, str, dict], ...] = ()
    """Further published transformers of the family for ``megaflow plan``: (the repository's name, as the last part
    of ``model.pretrained``, e.g. "Wan2.1-T2V-14B-Diffusers"; the table's name; its transformer config)."""
    encoder_params: int
    """Parameters of the published text encoders, for ``megaflow plan`` when the pipeline is not here."""
    vae_params: int
    """Parameters of the published VAE, likewise."""
    default_text_tokens: int
    """Text tokens of a sample when ``rollout.max_sequence_length`` is 0 (the pipeline's default)."""
    fixed_text_tokens: int
    """Text tokens beside T5's ``max_sequence_length`` (SD3: CLIP's 77)."""
    plan_dims: Callable[[dict], dict]
    """(diffusers transformer config) -> the family-specific fields of ``megaflow.plan.dit.DiTDims``, with the
    diffusers class's defaults for missing keys."""
    gpu_check_settings: tuple[str, ...]
    """``--set`` overrides of the family's train-step GPU check (``megaflow.testing.gpu.model``)."""
    shapes_pipeline: bool = False
    """True: ``megaflow pretrain`` builds the family's ShapeEval pipeline (``ModelFamily.shapes``)."""
    frames: bool = False
    """True: the family samples videos (``rollout.num_frames`` > 0, latents [B, C, F, H, W]); False: images."""
    temporal_compression: int = 1
    """Frames per latent frame of the VAE beyond the first: it takes k * temporal_compression + 1 frames."""
    axis_positions: tuple[str, int] | None = None
    """A video family's rotary table: (the transformer config key of its positions per axis, the diffusers default),
    bounding the latent frames and the token rows and columns; None: no such table."""

    def builtin_for(self, directory: str) -> tuple[str, dict]:
        """(name, transformer config) of the published model whose repository name is ``directory`` (case aside),
        else ``builtin``."""
        found = [(name, conf) for repo, name, conf in self.builtin_variants if repo.lower() == directory.lower()]
        return found[0] if found else self.builtin

    def latent_frames(self, num_frames: int) -> int:
        """Latent frames of a ``num_frames`` clip (the VAE keeps the first frame and compresses the rest)."""
        return (num_frames - 1) // self.temporal_compression + 1

    def cfg_copies(self, guidance_scale: float) -> int:
        """Copies of a sample the model runs on: 2 under classifier-free guidance, else 1."""
        return 2 if self.uses_cfg(guidance_scale) else 1

    def uses_cfg(self, guidance_scale: float) -> bool:
        """True when ``guidance_scale`` turns on classifier-free guidance (never under embedded guidance)."""
        return guidance_scale > 1.0 and not self.embedded_guidance

    def token_side(self, patch_size: int) -> int:
        """Latents per image-token side for a transformer of ``patch_size``."""
        return self.latent_pack or patch_size
