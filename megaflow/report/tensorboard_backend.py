"""The TensorBoard metrics backend (``logging.tensorboard``): event files in ``<run dir>/tensorboard/``.
Design notes: docs/design/report.md.
"""
from __future__ import annotations

from pathlib import Path

from megaflow.config.files import TENSORBOARD_DIR  # noqa: F401 (re-exported): "tensorboard"
GRID_COLUMNS = 4
GRID_PADDING = 2


class TensorBoardBackend:
    def __init__(self, run_dir: Path, *, start: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run_dir) / TENSORBOARD_DIR
        self._writer = SummaryWriter(str(self.log_dir), purge_step=start + 1 if start > 0 else None)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step)
        self._writer.flush()  # a killed run keeps what it logged

    def images(self, step: int, tag: str, images: list, captions: list[str]) -> None:
        """One grid image under ``tag`` (``GRID_COLUMNS`` a row, row by row, as the captions number them) and the
        numbered captions under ``<tag>/captions``."""
        import torch
        from torchvision.utils import make_grid

        if images:
            stacked = torch.stack([torch.as_tensor(img).permute(2, 0, 1) for img in images])
            grid = make_grid(stacked, nrow=min(GRID_COLUMNS, len(images)), padding=GRID_PADDING, pad_value=255)
            self._writer.add_image(tag, grid, global_step=step, dataformats="CHW")
        self._captions(step, tag, captions[:len(images)])

    def video(self, step: int, tag: str, frames, captions: list[str], *, fps: int) -> None:
        """An animated GIF (what TensorBoard plays as video, as ``add_video`` makes it; written by imageio, not
        moviepy) under ``tag`` and the numbered captions under ``<tag>/captions``."""
        import io

        import imageio.v3 as iio
        from torch.utils.tensorboard.summary import Summary

        gif = io.BytesIO()
        iio.imwrite(gif, frames, extension=".gif", duration=1000 / fps, loop=0)
        _, h, w, c = frames.shape
        image = Summary.Image(height=h, width=w, colorspace=c, encoded_image_string=gif.getvalue())
        self._writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)
        self._captions(step, tag, captions)

    def _captions(self, step: int, tag: str, captions: list[str]) -> None:
        lines = [f"{i:02d}: {caption}" for i, caption in enumerate(captions)]
        self._writer.add_text(f"{tag}/captions", "  \n".join(lines), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
