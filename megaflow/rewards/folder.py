"""Score a folder of images with one reward (``megaflow eval reward``): each image on its own via ``safe_score``
(failures ``None``), within a deadline (``timeout_s``); one line raised when no image was scored, else one warning
line for the whole folder when some were masked (never a line per image).
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence

from PIL import Image

from megaflow.config.manifest import ImageEntry
from megaflow.rewards.base import last_failure, note_failure, safe_score
from megaflow.rewards.registry import build_reward
from megaflow.rewards.scorer import RewardTimeout, call_within
from megaflow.shapeeval.score import check_image_files, open_image

logger = logging.getLogger("megaflow.rewards")


def _open(entry: ImageEntry) -> Image.Image:
    """The image as RGB; ValueError naming an unreadable file or one larger than ShapeEval's MAX_PIXELS (refused
    from its header)."""
    lazy = open_image(entry.path)
    try:
        with lazy as im:
            return im.convert("RGB")
    except Exception as e:  # noqa: BLE001 - whatever the decoder raises on a damaged file: one line naming it
        raise ValueError(f"cannot read image {entry.path}: {type(e).__name__}: {str(e)[:200]}") from None


def score_folder(entries: Sequence[ImageEntry], reward: str, kwargs: Mapping[str, object] | None = None, *,
                 timeout_s: float = 0.0) -> dict:
    """``{"reward", "files", "prompts", "scores", "mean", "masked"}``: one score per entry (None where the
    reward failed on that image, or was not done within ``timeout_s`` seconds for the folder; 0 = no limit), the
    mean of the others. ValueError (one line naming the reward and why) when no image was scored."""
    fn = build_reward(reward, **dict(kwargs or {}))
    check_image_files([e.path for e in entries])  # every file an image before the (possibly slow) scoring
    deadline = time.monotonic() + timeout_s if timeout_s else None
    scores: list[float | None] = []
    masked: list[tuple[str, str | None]] = []  # (file, why) of each image the reward failed on
    for entry in entries:
        left = deadline - time.monotonic() if deadline is not None else 0.0
        if deadline is not None and left <= 0:
            scores.append(None)
            continue
        try:
            s = float(call_within(lambda entry=entry: safe_score(fn, [_open(entry)], [entry.prompt],
                                                                 [dict(entry.metadata)], name=reward,
                                                                 warn=False)[0],
                                  left, name=reward))
        except RewardTimeout:
            note_failure(reward, f"timed out: the folder's --timeout-s {timeout_s:g} s ran out")
            s = math.nan
        scores.append(s if math.isfinite(s) else None)
        if not math.isfinite(s):
            masked.append((entry.file, last_failure(reward)))
    kept = [s for s in scores if s is not None]
    if not kept:
        raise ValueError(f"reward {reward!r} scored none of the {len(entries)} image{'s' if len(entries) > 1 else ''}"
                         f" ({last_failure(reward) or 'every score was masked'})")
    if len(kept) < len(entries):  # masked, or never tried once the folder's time ran out
        file, why = masked[0] if masked else ("-", "the folder's --timeout-s ran out")
        logger.warning("reward %s masked %d of %d images (first: %s: %s)", reward, len(entries) - len(kept),
                       len(entries), file, why or "masked")
    return {"reward": reward, "files": [e.file for e in entries], "prompts": [e.prompt for e in entries],
            "scores": scores, "mean": sum(kept) / len(kept), "masked": len(scores) - len(kept)}
