"""Reward interface, image-batch conversions, and the masking wrapper every reward runs through.

Design notes: docs/design/rewards.md.
"""
from __future__ import annotations

import abc
import logging
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from PIL import Image

logger = logging.getLogger("megaflow.rewards")
_LAST_FAILURE: dict[str, str] = {}  # reward name -> why it last masked a sample in this process


def note_failure(name: str, why: str) -> None:
    """Record why reward ``name`` masked samples (what :func:`last_failure` answers)."""
    _LAST_FAILURE[name] = why


def last_failure(name: str) -> str | None:
    """Why reward ``name`` last masked a sample in this process (``TypeError: ...``, ``returned non-finite
    values``), or None when it never did here: the loop's one-line stop of a useless run names it."""
    return _LAST_FAILURE.get(name)

ImageBatch = torch.Tensor | np.ndarray | Sequence[Image.Image]


class Reward(abc.ABC):
    """Base class for rewards; subclasses set ``name`` and implement ``__call__``."""

    name: str = "reward"

    @abc.abstractmethod
    def __call__(self, images: ImageBatch, prompts: Sequence[str],
                 metadata: Sequence[dict] | None = None) -> torch.Tensor:
        """Score a batch: float32 tensor [B]."""


def batch_size(images: ImageBatch) -> int:
    """Number of images in a batch (any supported form)."""
    return len(images) if not isinstance(images, torch.Tensor) else int(images.shape[0])


def to_uint8(images: ImageBatch) -> np.ndarray:
    """Images as a uint8 numpy array [B, H, W, 3] (float tensors are rounded from [0, 1])."""
    if isinstance(images, torch.Tensor):
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"image tensor must be [B, 3, H, W], got {tuple(images.shape)}")
        x = images.detach().to("cpu", torch.float32).clamp(0.0, 1.0)
        return (x * 255.0).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    if isinstance(images, np.ndarray):
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[3] != 3:
            raise ValueError(f"image array must be uint8 [B, H, W, 3], got {images.dtype} {images.shape}")
        return images
    return np.stack([np.asarray(im.convert("RGB"), dtype=np.uint8) for im in images])


def to_float(images: ImageBatch) -> torch.Tensor:
    """Images as a float32 tensor [B, 3, H, W] in [0, 1]."""
    if isinstance(images, torch.Tensor):
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"image tensor must be [B, 3, H, W], got {tuple(images.shape)}")
        return images.detach().to("cpu", torch.float32)
    return torch.from_numpy(to_uint8(images)).permute(0, 3, 1, 2).float() / 255.0


def to_pil(images: ImageBatch) -> list[Image.Image]:
    """Images as a list of RGB PIL images."""
    if not isinstance(images, (torch.Tensor, np.ndarray)):
        return [im.convert("RGB") for im in images]
    return [Image.fromarray(a) for a in to_uint8(images)]


def select(images: ImageBatch, i: int) -> ImageBatch:
    """A batch of one: the i-th image, in the same form."""
    if isinstance(images, (torch.Tensor, np.ndarray)):
        return images[i:i + 1]
    return [images[i]]


class RewardContractError(ValueError):
    """A reward returned something other than one score per image (one line naming it): a bug in the reward,
    which masking every sample would hide, so it stops the command."""


def _values(out, dtype, name: str):
    """``out`` (a tensor of any real dtype, bfloat16 included, an array, a number or a list) as a numpy array of
    ``dtype``; RewardContractError for a tensor with no values (the meta device) or complex ones, TypeError /
    ValueError for what is no number."""
    if isinstance(out, torch.Tensor):
        if out.device.type == "meta":
            raise RewardContractError(f"reward {name!r} returned a tensor on the meta device (it holds no values); "
                                      "a reward returns one number per image")
        if out.is_complex():
            raise RewardContractError(f"reward {name!r} returned complex scores ({out.dtype}); a reward returns one "
                                      "real number per image")
        out = out.detach().to("cpu", torch.float64 if dtype == np.float64 else torch.float32)
    return np.asarray(out, dtype=dtype)


def _as_scores(out, num: int, name: str) -> torch.Tensor:
    """Validate a reward's output: anything convertible to float32 of shape [num] (a tensor of any float dtype is
    converted); RewardContractError otherwise."""
    try:
        t = torch.as_tensor(_values(out, np.float32, name))
    except (TypeError, ValueError, RuntimeError) as e:
        if isinstance(e, RewardContractError):
            raise
        raise RewardContractError(f"reward {name!r} returned {type(out).__name__}, not scores ({str(e)[:80]}); a "
                                  "reward returns one number per image") from None
    if t.shape != (num,):
        raise RewardContractError(f"reward {name!r} returned scores of shape {tuple(t.shape)} for {num} image"
                                  f"{'s' if num != 1 else ''}; a reward returns one number per image, shape ({num},)")
    return t


def _split(out, name: str) -> tuple[object, dict[str, float], list[str]]:
    """A reward's output as (scores, info means, info keys that are no numbers: not reported): ``scores`` alone or
    a ``(scores, info dict)`` pair."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping)):
        return out, {}, []
    info, skipped = {}, []
    for key, value in out[1].items():
        try:
            arr = _values(value, np.float64, name).reshape(-1)
        except (TypeError, ValueError, RuntimeError):
            skipped.append(str(key))
            continue
        finite = arr[np.isfinite(arr)]
        info[str(key)] = float(finite.mean()) if finite.size else float("nan")
    return out[0], info, skipped


def _mean_info(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per key, the mean over the parts that report it (the info of a batch retried sample by sample)."""
    keys = dict.fromkeys(k for part in parts for k in part)
    return {k: float(np.mean([part[k] for part in parts if k in part])) for k in keys}


def failure(e: BaseException) -> str:
    """``Type: message`` of what a reward raised, on one line of at most 200 characters."""
    if isinstance(e, RewardRaised):
        return str(e)
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:200]}{'...' if len(text) > 200 else ''}"


class RewardRaised(Exception):
    """A reward raised a BaseException that is not a stop (``SystemExit``, ``GeneratorExit``, ...)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _call(reward, images: ImageBatch, prompts: list[str], meta: list[dict], name: str):
    """``reward(images, prompts, meta)`` split (``_split``) into (scores, info, info keys not reported); whatever it raises but a stop (Ctrl-C:
    KeyboardInterrupt and its subclasses) comes out as an Exception: a ``SystemExit`` or another BaseException
    from a reward is a reward failure, never the command's exit."""
    try:
        return _split(reward(images, prompts, meta), name)
    except (Exception, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit(0) inside a reward must not end train / eval reward
        raise RewardRaised(failure(e)) from None


def safe_score(reward, images: ImageBatch, prompts: Sequence[str],
               metadata: Sequence[dict] | None = None, *, name: str | None = None, warn: bool = True) -> torch.Tensor:
    """Run ``reward`` on a batch; never raises for reward failures. Returns float32 [B] with NaN
    for masked samples (the reward raised on that sample, or returned NaN/inf for it)."""
    return score_with_info(reward, images, prompts, metadata, name=name, warn=warn)[0]


def score_with_info(reward, images: ImageBatch, prompts: Sequence[str], metadata: Sequence[dict] | None = None,
                    *, name: str | None = None, warn: bool = True) -> tuple[torch.Tensor, dict[str, float]]:
    """``safe_score``'s scores and the reward's info as means, ``{key: float}`` (empty when it gives none). A
    batch the reward raised on is retried sample by sample; what it masked is ONE warning line for the batch
    (``warn``; False: the caller summarises, as ``megaflow eval reward`` does for its folder)."""
    name = name or getattr(reward, "name", type(reward).__name__)
    num = batch_size(images)
    if len(prompts) != num or (metadata is not None and len(metadata) != num):
        raise ValueError(f"reward {name!r}: {num} images but {len(prompts)} prompts"
                         f"{'' if metadata is None else f' and {len(metadata)} metadata'}")
    meta = list(metadata) if metadata is not None else [{} for _ in range(num)]
    raised: dict[int, str] = {}
    notes = []
    try:
        out, info, skipped = _call(reward, images, list(prompts), meta, name)
    except Exception as e:  # noqa: BLE001 - a reward's failure must never stop the run
        notes.append(f"raised on the batch of {num} ({failure(e)}), retried per sample")
        scores, infos, skipped = torch.full((num,), float("nan")), [], []
        for i in range(num):
            try:
                out, info_i, skipped_i = _call(reward, select(images, i), [prompts[i]], [meta[i]], name)
            except Exception as e_i:  # noqa: BLE001
                raised[i] = failure(e_i)
                continue
            scores[i] = _as_scores(out, 1, name)[0]  # a RewardContractError stops the command
            infos.append(info_i)
            skipped += [k for k in skipped_i if k not in skipped]
        info = _mean_info(infos)
        if raised:
            first = min(raised)
            notes.append(f"masked {len(raised)} of {num} (first: sample {first}, prompt {prompts[first][:80]!r}: "
                         f"{raised[first]})")
            _LAST_FAILURE[name] = failure(e)
    else:
        scores = _as_scores(out, num, name)  # a RewardContractError stops the command
    bad = [i for i in (~torch.isfinite(scores)).nonzero().flatten().tolist() if i not in raised]
    if bad:
        notes.append(f"returned non-finite values for {len(bad)} sample{'s' if len(bad) > 1 else ''} "
                     f"{bad[:8]}{'...' if len(bad) > 8 else ''}: masked")
        scores[bad] = float("nan")
        _LAST_FAILURE[name] = "returned non-finite values (NaN or inf)"
    if skipped:
        notes.append(f"info {', '.join(map(repr, skipped[:8]))} not a number or a list of numbers: not reported")
    if notes and warn:
        logger.warning("reward %s: %s", name, "; ".join(notes))
    return scores, info
