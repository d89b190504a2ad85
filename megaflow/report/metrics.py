"""Metrics: one JSON line per iteration in <run_dir>/metrics.jsonl, optional wandb (metrics and captioned sample
images, resumable); image grids.

``megaflow.report.progress.RunReporter`` writes through ``MetricsLog`` and prints what a person reads; a
resumed run first rewrites ``metrics.jsonl`` with its checkpoint's rows (``write_metrics_rows``).
"""
from __future__ import annotations

import json
import os
from pathlib import Path


WANDB_ID_FILE = "wandb_id"  # <run dir>/wandb_id: the W&B run id, so --resume continues the same W&B run
WANDB_MAX_IMAGES = 16  # sample images logged to W&B per sampled iteration (the first ones, groups in order)


def wandb_init_kwargs(run_dir: Path, config=None, *, resume: bool = False) -> dict:
    """``wandb.init`` keyword arguments of a run: ``logging.project`` / ``entity`` (empty: wandb's default) /
    ``tags`` of ``config`` (a MegaflowConfig; None: the default one), the run dir's name and ``<run dir>/wandb``
    for files, the config as a dict; ``resume`` with a stored ``<run dir>/wandb_id``: that id, resume="allow".
    No ``mode``: wandb decides online / offline itself (WANDB_MODE, ``wandb login``, WANDB_API_KEY)."""
    import dataclasses

    from megaflow.config import MegaflowConfig

    config = MegaflowConfig() if config is None else config
    kwargs = {"project": config.logging.project, "name": Path(run_dir).name, "dir": str(run_dir),
              "config": dataclasses.asdict(config), "tags": list(config.logging.tags)}
    if config.logging.entity:
        kwargs["entity"] = config.logging.entity
    id_file = Path(run_dir) / WANDB_ID_FILE
    if resume and id_file.is_file() and id_file.read_text().strip():
        kwargs.update(id=id_file.read_text().strip(), resume="allow")
    return kwargs


def _init_wandb(run_dir: Path, config, resume: bool):
    """``wandb.init`` of the run; its id stored in ``<run dir>/wandb_id``. No W&B credentials (and no
    WANDB_MODE) is a one-line ValueError."""
    import wandb as wb

    try:
        run = wb.init(**wandb_init_kwargs(run_dir, config, resume=resume))
    except wb.errors.UsageError as e:
        raise ValueError(f"logging.wandb: {e} (or set WANDB_MODE=offline to log under the run dir)") from None
    (Path(run_dir) / WANDB_ID_FILE).write_text(f"{run.id}\n")
    return run


class MetricsLog:
    """Appends one JSON object per ``write`` (``{"iteration": step, **metrics}``) to <run_dir>/metrics.jsonl,
    and with ``wandb`` logs the numbers (and ``log_images``) to a W&B run (``wandb_init_kwargs``)."""

    def __init__(self, run_dir: Path, *, enabled: bool = True, wandb: bool = False, config=None, resume: bool = False):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._fh = None
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = open(self.path, "a")
        if wandb:
            self._wandb = _init_wandb(Path(run_dir), config, resume)

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

    def log_images(self, step: int, images, captions: list[str]) -> None:
        """Log the first ``WANDB_MAX_IMAGES`` of ``images`` (N [3, H, W] tensors in [0, 1]) to W&B as
        ``samples``, each a ``wandb.Image`` with its caption; nothing without W&B."""
        if self._wandb is None:
            return
        import torch
        import wandb as wb

        pairs = list(zip(images, captions))[:WANDB_MAX_IMAGES]
        media = [wb.Image((img.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
                          .permute(1, 2, 0).numpy(), caption=caption) for img, caption in pairs]
        self._wandb.log({"samples": media}, step=step)

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
