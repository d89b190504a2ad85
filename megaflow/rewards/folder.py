"""Score a folder of images with one reward (``megaflow eval reward``).

The folder's ``manifest.jsonl`` is read and checked by ``megaflow.config.manifest.read_manifest``; each image
is scored on its own (images may differ in size) through ``safe_score``, so an image the reward fails on gets
``None`` and is left out of the mean rather than stopping the command.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from PIL import Image

from megaflow.config.manifest import ImageEntry
from megaflow.rewards.base import safe_score
from megaflow.rewards.registry import build_reward
from megaflow.shapeeval.score import open_image


def _open(entry: ImageEntry, *, decode: bool = True) -> Image.Image | None:
    """The image as RGB (``decode``), or only its header checked; ValueError naming an unreadable file or
    one larger than ShapeEval's MAX_PIXELS (refused from its header)."""
    lazy = open_image(entry.path)
    try:
        with lazy as im:
            return im.convert("RGB") if decode else None
    except OSError as e:
        raise ValueError(f"cannot read image {entry.path}: {e}") from None


def score_folder(entries: Sequence[ImageEntry], reward: str, kwargs: Mapping[str, object] | None = None) -> dict:
    """``{"reward", "files", "prompts", "scores", "mean", "masked"}``: one score per entry (None where the
    reward failed on that image), the mean of the others (None when none was scored)."""
    fn = build_reward(reward, **dict(kwargs or {}))
    for entry in entries:  # every file an image before the (possibly slow) scoring; decoded one at a time
        _open(entry, decode=False)
    scores: list[float | None] = []
    for entry in entries:
        s = float(safe_score(fn, [_open(entry)], [entry.prompt], [dict(entry.metadata)], name=reward)[0])
        scores.append(s if math.isfinite(s) else None)
    kept = [s for s in scores if s is not None]
    return {"reward": reward, "files": [e.file for e in entries], "prompts": [e.prompt for e in entries],
            "scores": scores, "mean": sum(kept) / len(kept) if kept else None,
            "masked": len(scores) - len(kept)}
