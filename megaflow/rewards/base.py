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


def _as_scores(out, num: int, name: str) -> torch.Tensor:
    """Validate a reward's output: anything convertible to float32 of shape [num]; RewardContractError otherwise."""
    try:
        t = torch.as_tensor(np.asarray(out.detach().cpu() if isinstance(out, torch.Tensor) else out,
                                       dtype=np.float32))
    except (TypeError, ValueError) as e:
        raise RewardContractError(f"reward {name!r} returned {type(out).__name__}, not scores ({str(e)[:80]}); a "
                                  "reward returns one number per image") from None
    if t.shape != (num,):
        raise RewardContractError(f"reward {name!r} returned scores of shape {tuple(t.shape)} for {num} image"
                                  f"{'s' if num != 1 else ''}; a reward returns one number per image, shape ({num},)")
    return t


def _split(out, name: str) -> tuple[object, dict[str, float]]:
    """A reward's output as (scores, info means): ``scores`` alone or a ``(scores, info dict)`` pair."""
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping)):
        return out, {}
    info = {}
    for key, value in out[1].items():
        try:
            arr = np.asarray(value.detach().cpu() if isinstance(value, torch.Tensor) else value,
                             dtype=np.float64).reshape(-1)
        except (TypeError, ValueError):
            logger.warning("reward %s: info %r is not a number or a list of numbers: not reported", name, key)
            continue
        finite = arr[np.isfinite(arr)]
        info[str(key)] = float(finite.mean()) if finite.size else float("nan")
    return out[0], info


def _mean_info(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per key, the mean over the parts that report it (the info of a batch retried sample by sample)."""
    keys = dict.fromkeys(k for part in parts for k in part)
    return {k: float(np.mean([part[k] for part in parts if k in part])) for k in keys}


def safe_score(reward, images: ImageBatch, prompts: Sequence[str],
               metadata: Sequence[dict] | None = None, *, name: str | None = None) -> torch.Tensor:
    """Run ``reward`` on a batch; never raises for reward failures. Returns float32 [B] with NaN
    for masked samples (the reward raised on that sample, or returned NaN/inf for it)."""
    return score_with_info(reward, images, prompts, metadata, name=name)[0]


def score_with_info(reward, images: ImageBatch, prompts: Sequence[str], metadata: Sequence[dict] | None = None,
                    *, name: str | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """``safe_score``'s scores and the reward's info as means, ``{key: float}`` (empty when it gives none)."""
    name = name or getattr(reward, "name", type(reward).__name__)
    num = batch_size(images)
    if len(prompts) != num or (metadata is not None and len(metadata) != num):
        raise ValueError(f"reward {name!r}: {num} images but {len(prompts)} prompts"
                         f"{'' if metadata is None else f' and {len(metadata)} metadata'}")
    meta = list(metadata) if metadata is not None else [{} for _ in range(num)]
    raised: set[int] = set()
    try:
        out, info = _split(reward(images, list(prompts), meta), name)
    except Exception as e:  # noqa: BLE001 - a reward's failure must never stop the run
        logger.warning("reward %s raised on a batch of %d (%s: %s); retrying per sample",
                       name, num, type(e).__name__, e)
        scores, infos = torch.full((num,), float("nan")), []
        for i in range(num):
            try:
                out, info_i = _split(reward(select(images, i), [prompts[i]], [meta[i]]), name)
            except Exception as e_i:  # noqa: BLE001
                raised.add(i)
                logger.warning("reward %s masked sample %d (prompt %r): %s: %s",
                               name, i, prompts[i], type(e_i).__name__, e_i)
                continue
            scores[i] = _as_scores(out, 1, name)[0]  # a RewardContractError stops the command
            infos.append(info_i)
        info = _mean_info(infos)
        if raised:
            _LAST_FAILURE[name] = f"{type(e).__name__}: {e}"
    else:
        scores = _as_scores(out, num, name)  # a RewardContractError stops the command
    bad = [i for i in (~torch.isfinite(scores)).nonzero().flatten().tolist() if i not in raised]
    if bad:
        logger.warning("reward %s returned non-finite values for samples %s: masked", name, bad)
        scores[bad] = float("nan")
        _LAST_FAILURE[name] = "returned non-finite values (NaN or inf)"
    return scores, info
