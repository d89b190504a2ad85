"""Reward registry: an explicit name -> factory table, custom rewards by ``"pkg.module:attr"``, and the
builder of one ``MultiReward`` from specs. Design notes: docs/design/rewards.md.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence

import torch

from megaflow.config.dotted import resolve
from megaflow.config.suggest import did_you_mean
from megaflow.rewards.aesthetic import AestheticReward
from megaflow.rewards.base import to_float
from megaflow.rewards.frames import FrameReward, frame_mode, takes_video
from megaflow.rewards.cifar import Cifar10Reward
from megaflow.rewards.clip import ClipScore, PickScore
from megaflow.rewards.color import ColorTarget
from megaflow.rewards.hps import HpsV2
from megaflow.rewards.imagereward import ImageRewardScore
from megaflow.rewards.jpeg import JpegCompressibility, JpegIncompressibility
from megaflow.rewards.ocr import OcrReward
from megaflow.rewards.remote import RemoteJsonReward, RemoteReward, VlmJudge
from megaflow.rewards.scorer import MultiReward
from megaflow.rewards.shapes import ShapeEvalReward

REWARDS: dict[str, Callable[..., object]] = {
    "jpeg_compressibility": JpegCompressibility,
    "jpeg_incompressibility": JpegIncompressibility,
    "color_target": ColorTarget,
    "shapeeval": functools.partial(ShapeEvalReward, graded=False),
    "shapeeval_partial": functools.partial(ShapeEvalReward, graded=True),
    "cifar10": Cifar10Reward,
    "ocr": OcrReward,
    "remote": RemoteReward,
    "remote_json": RemoteJsonReward,
    "vlm_judge": VlmJudge,
    "clipscore": ClipScore,
    "pickscore": PickScore,
    "aesthetic": AestheticReward,
    "imagereward": ImageRewardScore,
    "hpsv2": HpsV2,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardSpec:
    """One reward term of the objective."""

    name: str
    """Registry key (see ``REWARDS``) or ``"pkg.module:attr"``."""
    weight: float = 1.0
    """Multiplier in the total reward; 0 = report only."""
    kwargs: Mapping[str, object] = dataclasses.field(default_factory=dict)
    """Constructor (class) or call (function) keyword arguments."""
    label: str | None = None
    """Key in logs and ``RewardScores.components``; defaults to ``name``."""


CUSTOM_IMAGES = "a float32 CPU tensor [B, 3, H, W] in [0, 1] (a reward that takes video: clips [B, F, 3, H, W])"


class _CustomReward:
    """A ``'pkg.mod:attr'`` reward: a function with its configured keyword arguments bound, or the instance a class
    made; either is handed the images as ``CUSTOM_IMAGES`` (``to_float``), whatever form the caller has."""

    def __init__(self, fn: Callable, name: str, kwargs: Mapping[str, object] | None = None):
        self.fn, self.name, self.kwargs = fn, name, kwargs

    def __call__(self, images, prompts, metadata=None):
        video = isinstance(images, torch.Tensor) and images.ndim == 5 and takes_video(self)
        images = images.detach().to("cpu", torch.float32) if video else to_float(images)
        if self.kwargs is None:
            return self.fn(images, prompts, metadata)
        return self.fn(images, prompts, metadata, **self.kwargs)


def _instantiate(factory: Callable, name: str, kwargs: Mapping[str, object]):
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as e:
        raise ValueError(f"reward {name!r}: bad arguments {dict(kwargs)} ({e})") from None
    except ValueError:  # no signature available (builtins): let the call decide
        pass
    try:
        return factory(**kwargs)
    except (Exception, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit(0) while a reward is built must not end the command
        raise ValueError(f"reward {name!r}: building it raised {type(e).__name__}: {str(e)[:200]}") from None


def build_reward(name: str, **kwargs) -> Callable:
    """A reward callable from a registry key or a dotted path (see the module's design notes)."""
    if ":" in name:
        target = resolve(name, "reward")
        if not callable(target):
            raise ValueError(f"reward {name!r} is not callable")
        if not inspect.isclass(target):
            return _CustomReward(target, name, dict(kwargs))
        reward = _instantiate(target, name, kwargs)
        if not callable(reward):
            raise ValueError(f"reward {name!r}: class instance is not callable")
        return _CustomReward(reward, name)
    if name not in REWARDS:
        raise ValueError(f"unknown reward {name!r}{did_you_mean(name, REWARDS)} (known: {', '.join(REWARDS)}; "
                         "or 'pkg.module:callable')")
    return _instantiate(REWARDS[name], name, kwargs)


def _coerce(spec: RewardSpec | Mapping) -> RewardSpec:
    if isinstance(spec, RewardSpec):
        return spec
    unknown = set(spec) - {f.name for f in dataclasses.fields(RewardSpec)}
    if unknown:
        raise ValueError(f"unknown reward spec key(s) {sorted(unknown)} in {dict(spec)}")
    if "name" not in spec:
        raise ValueError(f"reward spec without 'name': {dict(spec)}")
    return RewardSpec(**spec)


def build_multi_reward(specs: Sequence[RewardSpec | Mapping] | Mapping[str, float],
                       kwargs: Mapping[str, Mapping] | None = None, *, timeout_s: float = 0.0,
                       frames: str = "mean") -> MultiReward:
    """One ``MultiReward`` from either a list of specs (``RewardSpec`` or plain dicts from a TOML
    config), or the config's ``{name: weight}`` table with optional ``{name: kwargs}``; ``timeout_s``: each
    component's time limit per batch (0 = none; see megaflow.rewards.scorer); ``frames``: how each scores a video
    (``reward.frames``, megaflow.rewards.frames)."""
    if isinstance(specs, Mapping):
        kwargs = dict(kwargs or {})
        stray = sorted(set(kwargs) - set(specs))
        if stray:
            raise ValueError(f"reward kwargs given for reward(s) {stray} that have no weight")
        specs = [RewardSpec(name=n, weight=w, kwargs=kwargs.get(n, {})) for n, w in specs.items()]
    elif kwargs:
        raise ValueError("reward kwargs go inside each spec when specs are a list")
    specs = [_coerce(s) for s in specs]
    mode = frame_mode(frames)
    return MultiReward([(s.label or s.name, _weight(s),
                         FrameReward(build_reward(s.name, **dict(s.kwargs)), mode, label=s.label or s.name))
                        for s in specs], timeout_s=timeout_s)


def _weight(spec: RewardSpec) -> float:
    try:
        return float(spec.weight)
    except (TypeError, ValueError):
        raise ValueError(f"reward {spec.name!r}: weight must be a number, got {spec.weight!r}") from None
