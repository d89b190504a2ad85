"""The W&B metrics backend (``logging.wandb``): one W&B run per run dir, continued by ``--resume``; W&B ignores
steps below one it has, so after resuming from an older checkpoint the earlier-logged values stay.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from megaflow.config.files import WANDB_ID_FILE  # <run dir>/wandb_id: the W&B run id, so --resume continues it


def wandb_init_kwargs(run_dir: Path, config=None, *, resume: bool = False) -> dict:
    """``wandb.init`` keyword arguments of a run: ``logging.project`` / ``entity`` (empty: wandb's default) /
    ``tags`` of ``config`` (a MegaflowConfig; None: the default one), the run dir's name and ``<run dir>/wandb``
    for files, the config as a dict; ``resume`` with a stored ``<run dir>/wandb_id``: that id, resume="allow".
    No ``mode``: wandb decides online / offline itself (WANDB_MODE, ``wandb login``, WANDB_API_KEY)."""
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


class WandbBackend:
    """``wandb.init`` of the run (``wandb_init_kwargs``), its id stored in ``<run dir>/wandb_id``. No W&B
    credentials (and no WANDB_MODE) is a one-line ValueError."""

    def __init__(self, run_dir: Path, config, *, resume: bool = False):
        import wandb as wb

        Path(run_dir).mkdir(parents=True, exist_ok=True)
        try:
            self.run = wb.init(**wandb_init_kwargs(run_dir, config, resume=resume))
        except wb.errors.UsageError as e:
            raise ValueError(f"logging.wandb: {e} (or set WANDB_MODE=offline to log under the run dir)") from None
        (Path(run_dir) / WANDB_ID_FILE).write_text(f"{self.run.id}\n")
        self.media_dir = Path(run_dir) / "wandb_media"

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def images(self, step: int, tag: str, images: list, captions: list[str]) -> None:
        import wandb as wb
        self.run.log({tag: [wb.Image(img, caption=c) for img, c in zip(images, captions)]}, step=step)

    def video(self, step: int, tag: str, frames, captions: list[str], *, fps: int) -> None:
        """An MP4 (written by ``report.video.write_video`` into the run dir's ``wandb_media``) as a ``wandb.Video``
        captioned with its clips' captions."""
        import wandb as wb

        from megaflow.report.video import write_video
        path = write_video(frames, self.media_dir / f"{tag.replace('/', '_')}-{step:06d}.mp4", fps=fps)
        self.run.log({tag: wb.Video(str(path), caption=" | ".join(captions), format="mp4")}, step=step)

    def close(self) -> None:
        """Finish the run, then wait for wandb's service process to write and close the run's files
        (``run.finish`` only informs it; the atexit teardown that would wait is unreliable beside spawned
        workers, and a run dir was seen missing a session's history)."""
        import wandb as wb

        self.run.finish()
        wb.teardown()
