"""Metrics: one JSON line per iteration in <run_dir>/metrics.jsonl, optional wandb; image grids.

``megaflow.report.progress.RunReporter`` writes through ``MetricsLog`` and prints what a person reads; a
resumed run first rewrites ``metrics.jsonl`` with its checkpoint's rows (``write_metrics_rows``).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path


def wandb_mode(env: Mapping[str, str] = os.environ) -> str:
    """The wandb mode from the environment: ``WANDB_MODE`` when set, else "online" when ``WANDB_API_KEY``
    is set, else "offline" (runs are written under the run dir for a later ``wandb sync``)."""
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    return "online" if env.get("WANDB_API_KEY") else "offline"


class MetricsLog:
    """Appends one JSON object per ``write`` (``{"iteration": step, **metrics}``) to <run_dir>/metrics.jsonl."""

    def __init__(self, run_dir: Path, *, enabled: bool = True, wandb: bool = False, config=None):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._fh = None
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a")
        if wandb:
            import dataclasses

            import wandb as wb
            self._wandb = wb.init(project="megaflow", name=Path(run_dir).name, mode=wandb_mode(),
                                  dir=str(run_dir), config=dataclasses.asdict(config) if config else None)

    def write(self, step: int, metrics: dict) -> dict:
        """Append one row (numbers as floats) and return it."""
        clean = {k: (float(v) if isinstance(v, (int, float)) else v) for k, v in metrics.items()}
        row = {"iteration": step, **clean}
        if self.enabled:
            self._fh.write(json.dumps(row, sort_keys=True, default=str) + "\n")
            self._fh.flush()
            if self._wandb is not None:
                self._wandb.log({k: v for k, v in clean.items() if isinstance(v, float)}, step=step)
        return row

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
        if self._wandb is not None:
            self._wandb.finish()


def write_metrics_rows(run_dir: Path, rows: list[dict]) -> None:
    """Replace ``metrics.jsonl`` with ``rows`` atomically (a fresh run: none; a resumed one: the checkpoint's)."""
    path = Path(run_dir) / "metrics.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, sort_keys=True, default=str) + "\n" for r in rows))
    os.replace(tmp, path)


def save_image_grid(images, path: Path, *, columns: int, scale: int = 1, labels: list[str] | None = None) -> Path:
    """Save ``images`` ([N, 3, H, W] float in [0, 1]) as one PNG grid, ``columns`` per row (a group per row),
    each image enlarged ``scale`` times (nearest neighbour); with ``labels`` each image gets its text under it,
    wrapped to the image's width."""
    import textwrap

    import numpy as np
    import torch
    from PIL import Image, ImageDraw

    x = (images.clamp(0, 1) * 255).round().to(dtype=torch.uint8).permute(0, 2, 3, 1).numpy()
    x = x.repeat(scale, axis=1).repeat(scale, axis=2)
    n, h, w, _ = x.shape
    width_chars = max(8, w // 6)  # PIL's default bitmap font is ~6 px per character
    wrapped = [textwrap.wrap(t, width_chars) for t in labels] if labels is not None else None
    text_h = 11 * max((len(lines) for lines in wrapped), default=0) + 4 if wrapped else 0
    rows = -(-n // columns)
    cell_h = h + text_h
    grid = np.full((rows * cell_h, columns * w, 3), 255, dtype=np.uint8)
    for i in range(n):
        r, c = divmod(i, columns)
        grid[r * cell_h:r * cell_h + h, c * w:(c + 1) * w] = x[i]
    image = Image.fromarray(grid)
    if wrapped:
        draw = ImageDraw.Draw(image)
        for i, lines in enumerate(wrapped):
            r, c = divmod(i, columns)
            draw.multiline_text((c * w + 2, r * cell_h + h + 2), "\n".join(lines), fill=(0, 0, 0), spacing=1)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
