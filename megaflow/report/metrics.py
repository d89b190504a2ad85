"""Metrics: one JSON line per iteration in <run_dir>/metrics.jsonl, the same to the backends; image grids (a video's
in report/video.py).
A resumed run first rewrites ``metrics.jsonl`` with its checkpoint's rows.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

from megaflow.report.backends import MAX_IMAGES, MetricsBackend, numbers, to_uint8, uint8_images
from megaflow.report.video import clip_grid, is_clip

VIDEO_COLUMNS = 4  # clips a row in a backend's video of grids


class Evaluation(NamedTuple):
    """What an evaluation hook (megaflow.commands.evaluation, the demo's) hands the reporter: its ``eval/*`` figures
    and images ([3, H, W] tensors in [0, 1]; clips [F, 3, H, W]) with one caption each (prompt and score)."""

    figures: dict
    images: list
    captions: list[str]


class MetricsLog:
    """Appends one JSON object per ``write`` (``{"iteration": step, **metrics}``) to <run_dir>/metrics.jsonl
    and gives its numbers to every backend; ``log`` and ``log_images`` go to the backends only. Closing it
    closes them."""

    def __init__(self, run_dir: Path, *, enabled: bool = True, backends: list[MetricsBackend] = ()):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.backends = list(backends)
        self._fh = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a")

    def write(self, step: int, metrics: dict) -> dict:
        """Append one row (numbers as floats), log its numbers to the backends and return it."""
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        row = {"iteration": step, **clean}
        if self.enabled:
            self._fh.write(json.dumps(row, sort_keys=True, default=str) + "\n")
            self._fh.flush()
            self.log(step, clean)
        return row

    def log(self, step: int, values: dict) -> None:
        """The numbers among ``values`` to every backend at ``step`` (an evaluation's figures, which are no
        metrics.jsonl row)."""
        if self.enabled and self.backends and (values := numbers(values)):
            for b in self.backends:
                b.scalars(step, values)

    def log_images(self, step: int, tag: str, images, captions: list[str], *, fps: int = 16) -> None:
        """The first ``backends.MAX_IMAGES`` of ``images`` (N [3, H, W] tensors in [0, 1]) with their captions
        to every backend under ``tag`` at ``step``; clips (N [F, 3, H, W]) go as one video of grids at ``fps``."""
        if not (self.enabled and self.backends):
            return
        if images and is_clip(images[0]):
            first = list(images)[:MAX_IMAGES]
            frames = clip_grid(first, columns=min(VIDEO_COLUMNS, len(first)))
            for b in self.backends:
                b.video(step, tag, frames, list(captions)[:len(first)], fps=fps)
            return
        arrays = to_uint8(images)
        for b in self.backends:
            b.images(step, tag, arrays, list(captions)[:len(arrays)])

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        for b in self.backends:
            b.close()
        self.backends = []


def write_metrics_rows(run_dir: Path, rows: list[dict]) -> None:
    """Replace ``metrics.jsonl`` with ``rows`` atomically (a fresh run: none; a resumed one: the checkpoint's)."""
    path = Path(run_dir) / "metrics.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in rows))
    os.replace(tmp, path)


def save_image_grid(images, path: Path, *, columns: int, scale: int = 1, labels: list[str] | None = None) -> Path:
    """Save ``images`` ([N, 3, H, W] float in [0, 1]) as one PNG grid (``grid_array``)."""
    from PIL import Image

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid_array(images, columns=columns, scale=scale, labels=labels)).save(path)
    return path


def grid_array(images, *, columns: int, scale: int = 1, labels: list[str] | None = None):
    """``images`` ([N, 3, H, W] float in [0, 1]) as one uint8 [H', W', 3] grid, ``columns`` per row (a group per
    row), each image enlarged ``scale`` times (nearest neighbour) and laid out by ``torchvision.utils.make_grid``;
    with ``labels`` each image gets its text in a white band under it, wrapped to the image's width."""
    import textwrap

    import numpy as np
    import torch
    from PIL import Image, ImageDraw
    from torchvision.utils import make_grid

    x = torch.as_tensor(uint8_images(images)).permute(0, 3, 1, 2)  # uint8 [N, 3, H, W], rounded as every grid is
    x = x.repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3)
    n, _, h, w = x.shape
    width_chars = max(8, w // 6)  # PIL's default bitmap font is ~6 px per character
    wrapped = [textwrap.wrap(t, width_chars) for t in labels] if labels is not None else None
    text_h = 11 * max((len(lines) for lines in wrapped), default=0) + 4 if wrapped else 0
    x = torch.nn.functional.pad(x, (0, 0, 0, text_h), value=255)  # the caption band under each image
    grid = make_grid(x, nrow=columns, padding=0, pad_value=255)
    image = Image.fromarray(grid.permute(1, 2, 0).numpy())
    if wrapped:
        draw = ImageDraw.Draw(image)
        for i, lines in enumerate(wrapped):
            r, c = divmod(i, columns)
            draw.multiline_text((c * w + 2, r * (h + text_h) + h + 2), "\n".join(lines), fill=(0, 0, 0), spacing=1)
    return np.asarray(image)
