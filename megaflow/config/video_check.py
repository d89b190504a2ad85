"""A config's video rules, before anything starts: a video family samples ``rollout.num_frames`` frames and an image
family none; the VAE takes k * temporal_compression + 1 frames; the latent frames and token rows / columns fit the
rotary table; a video run evaluates on data.test_prompts (not ShapeEval); ``reward.frames`` names a mode or frame the clips have, and "video" only for rewards that take video.
Invariant: standard library only; what a family samples is its card (``frames``, ``temporal_compression``,
``axis_positions``)."""
from __future__ import annotations

from megaflow.config.dotted import resolve
from megaflow.config.load import ConfigError
from megaflow.config.schema import MegaflowConfig
from megaflow.families import card

FRAME_WORDS = ("mean", "first", "video")  # megaflow.rewards.frames.FRAME_MODES (a test keeps them equal)


def check_frames(cfg: MegaflowConfig, *, files: bool = True) -> None:
    """``rollout.num_frames`` against the family and its VAE, and ``reward.frames`` (no files read but a custom
    reward's module, with ``files``)."""
    r, family = cfg.rollout, card(cfg.model.family)
    n, step = r.num_frames, family.temporal_compression
    if family.frames and not n:
        raise ConfigError(f"model.family = {family.name!r} samples videos: set rollout.num_frames (k * {step} + 1 "
                          f"frames, e.g. {20 * step + 1})")
    if not family.frames and n:
        raise ConfigError(f"rollout.num_frames = {n}: model.family = {family.name!r} samples images (set "
                          "rollout.num_frames = 0, or a video family)")
    if n and (n - 1) % step:
        low = (n - 1) // step * step + 1
        raise ConfigError(f"rollout.num_frames = {n}: {family.title}'s VAE compresses {step} frames into one after "
                          f"the first, so it takes k * {step} + 1 frames ({low} or {low + step})")
    if n and cfg.eval.every and not cfg.data.test_prompts:
        raise ConfigError(f"eval.every = {cfg.eval.every} without data.test_prompts evaluates with ShapeEval, which "
                          "scores images: set data.test_prompts for a video run (its clips are scored by the rewards)")
    _check_reward_frames(cfg, files=files)


def _check_reward_frames(cfg: MegaflowConfig, *, files: bool) -> None:
    mode, n = cfg.reward.frames, cfg.rollout.num_frames
    if mode not in FRAME_WORDS and not mode.isdigit():
        raise ConfigError(f"reward.frames = {mode!r}: must be one of {', '.join(FRAME_WORDS)} or a frame index "
                          "(\"8\")")
    if not n:
        return
    if mode.isdigit() and int(mode) >= n:
        raise ConfigError(f"reward.frames = {mode!r}: the clips have {n} frames (rollout.num_frames; indices "
                          f"0 .. {n - 1})")
    if mode != "video":
        return
    for name in cfg.reward.weights:
        if ":" not in name or (files and not getattr(resolve(name, "reward"), "takes_video", False)):
            raise ConfigError(f"reward.frames = 'video' hands whole clips to every reward, but {name!r} scores "
                              "images: set reward.frames to mean, first or a frame index (a 'pkg.mod:fn' reward "
                              "that takes video sets takes_video = True)")


def check_positions(cfg: MegaflowConfig, tconf: dict | None, where: str, multiple: int) -> None:
    """A video's latent frames and token rows / columns within the rotary table of ``where`` (``tconf``: its
    transformer config; None: the tiny pipeline built for the run); ``multiple``: pixels per token side."""
    r, family = cfg.rollout, card(cfg.model.family)
    if not r.num_frames or family.axis_positions is None:
        return
    key, default = family.axis_positions
    positions = family.tiny_positions if tconf is None else tconf.get(key, default)
    if not isinstance(positions, int) or isinstance(positions, bool) or positions < 1:
        raise ConfigError(f"{where}/transformer/config.json: {key} must be a positive integer, got {positions!r}")
    latent = family.latent_frames(r.num_frames)
    if latent > positions:
        raise ConfigError(f"rollout.num_frames = {r.num_frames}: {latent} latent frames, more than the {positions} "
                          f"positions per axis of the rotary table of {where} ({key})")
    for side in ("height", "width"):
        tokens = getattr(r, side) // multiple
        if tokens > positions:
            raise ConfigError(f"rollout.{side} = {getattr(r, side)}: {tokens} tokens, more than the {positions} "
                              f"positions per axis of the rotary table of {where} ({key})")
