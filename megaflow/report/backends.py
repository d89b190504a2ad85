"""The metrics backends (W&B, TensorBoard) a run's numbers, images and evaluations go to besides its files.
Invariant: a backend gets steps in non-decreasing order (an evaluation shares its iteration's step).
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

MAX_IMAGES = 16  # images a backend gets per call: the first ones (a sample batch: groups in order)


class MetricsBackend(Protocol):
    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Log ``values`` (name -> number) at ``step``."""

    def images(self, step: int, tag: str, images: list, captions: list[str]) -> None:
        """Log ``images`` (at most ``MAX_IMAGES`` HxWx3 uint8 arrays) under ``tag`` at ``step``, one caption
        each."""

    def video(self, step: int, tag: str, frames, captions: list[str], *, fps: int) -> None:
        """Log one video (uint8 frames [F, H, W, 3]: a grid of clips) under ``tag`` at ``step``, played at ``fps``,
        with the captions of its clips in grid order."""

    def close(self) -> None:
        """Write out what is pending and end the backend's run."""


def open_backends(run_dir: Path, cfg, *, start: int = 0) -> list[MetricsBackend]:
    """The backends ``cfg.logging`` turns on for ``run_dir``; ``start`` > 0: a run resumed after iteration
    ``start`` (W&B continues its run; TensorBoard drops what a previous session logged after ``start``)."""
    from megaflow.config.files import check_backend_paths
    check_backend_paths(Path(run_dir), wandb=cfg.logging.wandb, tensorboard=cfg.logging.tensorboard)  # one line
    backends: list[MetricsBackend] = []
    try:
        if cfg.logging.wandb:
            from megaflow.report.wandb_backend import WandbBackend
            backends.append(WandbBackend(Path(run_dir), cfg, resume=start > 0))
        if cfg.logging.tensorboard:
            from megaflow.report.tensorboard_backend import TensorBoardBackend
            backends.append(TensorBoardBackend(Path(run_dir), start=start))
    except BaseException:
        for b in backends:
            b.close()
        raise
    return backends


def numbers(values: dict) -> dict[str, float]:
    """The entries of ``values`` that are numbers (bools and ints included), as floats."""
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}


def uint8_images(images):
    """HxWx3 uint8 arrays [N, H, W, 3] of ``images`` (an [N, 3, H, W] tensor or N [3, H, W] tensors, in [0, 1]):
    clamped, scaled and rounded -- the one rounding of the sample grids and of every backend's images."""
    import torch
    x = torch.stack([img.detach().float().cpu() for img in images])
    return (x.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def to_uint8(images) -> list:
    """The first ``MAX_IMAGES`` of ``images`` (N [3, H, W] tensors in [0, 1]) as HxWx3 uint8 arrays
    (``uint8_images``)."""
    first = list(images)[:MAX_IMAGES]
    return list(uint8_images(first)) if first else []
