"""Video samples (megaflow.report.video): clips [N, F, 3, H, W] become one grid per frame, written by imageio as MP4
(H.264) or GIF and read back by imageio: F frames in order, the frame rate asked, each frame the image grid of that
frame (solid-colour clips, so the codecs' loss stays small: MP4 mean error < 4/255, GIF's palette exact on these
colours); a run's samples and TensorBoard get the same clips as video (an animated GIF image summary read back with
TensorBoard's own reader). Needs: CPU, 1 process (~5 s)."""
from __future__ import annotations

import io

import imageio.v2 as iio2
import imageio.v3 as iio
import numpy as np
import pytest
import torch

from megaflow.config import load_config
from megaflow.report.metrics import grid_array
from megaflow.report.progress import RunReporter
from megaflow.report.video import clip_grid, save_video_grid

COLOURS = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])


def _clips(n: int = 3, frames: int = 5, h: int = 16, w: int = 24) -> torch.Tensor:
    """Clip i's frame f is one solid colour, COLOURS[(i + f) % 5]: every frame of the grid differs."""
    colours = torch.stack([torch.stack([COLOURS[(i + f) % 5] for f in range(frames)]) for i in range(n)])
    return colours[..., None, None].expand(n, frames, 3, h, w).contiguous()


def test_clip_grid_is_the_image_grid_of_each_frame():
    clips = _clips()
    grid = clip_grid(clips, columns=2, labels=["a", "b", "c"])
    assert grid.shape[0] == 5 and grid.dtype == np.uint8
    for f in range(5):
        assert np.array_equal(grid[f], grid_array(clips[:, f], columns=2, labels=["a", "b", "c"]))


@pytest.mark.parametrize("suffix", [".mp4", ".gif"])
def test_video_file_reads_back_frame_by_frame(tmp_path, suffix):
    clips = _clips()
    want = clip_grid(clips, columns=3).astype(np.float32)
    path = save_video_grid(clips, tmp_path / f"samples{suffix}", columns=3, fps=8)
    if suffix == ".mp4":
        got = np.stack(iio2.mimread(path, format="FFMPEG")).astype(np.float32)
        assert iio2.get_reader(path, format="FFMPEG").get_meta_data()["fps"] == 8
        assert got.shape[0] == 5 and np.abs(got[:, :want.shape[1], :want.shape[2]] - want).mean() < 4
    else:
        got = iio.imread(path, index=None).astype(np.float32)[..., :3]
        assert iio.immeta(path)["duration"] == pytest.approx(125, abs=5)  # ms a frame at 8 fps (GIF: 10 ms units)
        assert got.shape == want.shape and np.array_equal(got, want)


def test_a_video_run_writes_mp4_samples_and_tensorboard_video(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(None, ["logging.tensorboard=true", "logging.sample_every=1", "rollout.group_size=2",
                             "rollout.fps=8"])
    reporter = RunReporter(tmp_path, cfg, enabled=True, verbose=True, total_iterations=1)
    clips = _clips(n=2)
    reporter.iteration(1, {"reward/total": 0.5}, images=list(clips), captions=["a red cat", "a blue dog"])
    reporter.close()
    frames = np.stack(iio2.mimread(tmp_path / "samples" / "iter00001.mp4", format="FFMPEG"))
    assert frames.shape[0] == 5
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    acc.Reload()
    (event,) = acc.Images("samples")
    gif = iio.imread(io.BytesIO(event.encoded_image_string), index=None)
    assert event.step == 1 and gif.shape[0] == 5
    assert np.array_equal(gif[..., :3], clip_grid(clips, columns=2))
