"""The TensorBoard metrics backend (``logging.tensorboard``): event files in ``<run dir>/tensorboard/``.
Design notes: docs/design/report.md.
"""
from __future__ import annotations

from pathlib import Path

from megaflow.config.files import TENSORBOARD_DIR  # noqa: F401 (re-exported): "tensorboard"


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
        for i, img in enumerate(images):
            self._writer.add_image(f"{tag}/{i:02d}", img, global_step=step, dataformats="HWC")
        lines = [f"{i:02d}: {caption}" for i, caption in enumerate(captions[:len(images)])]
        self._writer.add_text(f"{tag}/captions", "  \n".join(lines), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
