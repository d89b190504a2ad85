"""Video samples: clips [N, F, 3, H, W] float in [0, 1] laid out as one grid per frame (``metrics.grid_array``:
the image grids' layout, captions and rounding) and written by imageio as a short MP4 or GIF, the file a metrics
backend logs as video. Invariant: a clip's frames stay in order on their own axis; nothing here encodes by hand."""
from __future__ import annotations

from pathlib import Path

FORMATS = (".mp4", ".gif")


def is_clip(sample) -> bool:
    """Whether one sample is a video ([F, 3, H, W]) rather than an image ([3, H, W] or HxWx3)."""
    return getattr(sample, "ndim", 0) == 4


def clip_grid(clips, *, columns: int, scale: int = 1, labels: list[str] | None = None):
    """uint8 [F, H', W', 3]: frame f is the grid of every clip's frame f (all clips have F frames)."""
    import numpy as np
    import torch

    from megaflow.report.metrics import grid_array

    stacked = torch.stack([torch.as_tensor(c).detach().float().cpu() for c in clips])  # [N, F, 3, H, W]
    return np.stack([grid_array(stacked[:, f], columns=columns, scale=scale, labels=labels)
                     for f in range(stacked.shape[1])])


def write_video(frames, path: Path, *, fps: int) -> Path:
    """Write uint8 frames [F, H, W, 3] to ``path`` (.mp4: H.264 yuv420p by imageio's ffmpeg, sides padded to even
    with white; .gif: looping, by Pillow)."""
    import imageio.v2 as iio2
    import imageio.v3 as iio
    import numpy as np

    path = Path(path)
    if path.suffix not in FORMATS:
        raise ValueError(f"a video sample is one of {', '.join(FORMATS)}, got {path.name}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".gif":
        iio.imwrite(path, frames, extension=".gif", duration=1000 / fps, loop=0)
    else:
        _, h, w, _ = frames.shape
        even = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), constant_values=255)
        iio2.mimwrite(path, even, format="FFMPEG", fps=fps, codec="libx264", pixelformat="yuv420p",
                      macro_block_size=2)
    return path


def save_video_grid(clips, path: Path, *, columns: int, fps: int, scale: int = 1,
                    labels: list[str] | None = None) -> Path:
    """``clips`` as one video of grids (``clip_grid``) at ``fps`` frames per second, written to ``path``."""
    return write_video(clip_grid(clips, columns=columns, scale=scale, labels=labels), path, fps=fps)
