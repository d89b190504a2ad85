"""logging.tensorboard: the TensorBoard backend's event files read back with TensorBoard's own reader
(EventAccumulator): every metrics row's numbers as scalars (float32) at step = iteration, an evaluation's
figures at its step, images and their captions; a resumed run hides the steps an earlier session logged past the
checkpoint; without the tensorboard package `megaflow train` stops at preflight with one line and no heavy
import. Needs: CPU, 1 process (~5 s)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megaflow.config import load_config
from megaflow.report.metrics import Evaluation
from megaflow.report.progress import RunReporter
from megaflow.report import tensorboard_backend
from megaflow.report.tensorboard_backend import TensorBoardBackend

REPO = Path(__file__).resolve().parents[2]


def read_events(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalar_series(acc: EventAccumulator) -> dict[str, list[tuple[int, float]]]:
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def f32(v: float) -> float:
    return float(np.float32(v))


def test_reporter_rows_evaluations_and_images_read_back(tmp_path):
    cfg = load_config(None, ["logging.tensorboard=true", "logging.sample_every=2", "rollout.group_size=2",
                             "rollout.prompts_per_iter=2", "logging.log_every=5"])
    reporter = RunReporter(tmp_path, cfg, enabled=True, verbose=False, total_iterations=2)
    images = [torch.full((3, 4, 6), k / 7) for k in range(4)]
    captions = [f"prompt {k} | reward {k / 10:.3f}" for k in range(4)]
    reporter.iteration(0, {"sync/verified": True, "sync/tensors": 12})
    reporter.evaluation(0, Evaluation({"eval/reward_total": 0.1, "eval/num": 4, "eval/none": None},
                                      images, captions))
    for it in (1, 2):
        reporter.iteration(it, {"reward/total": 0.1 * it + 1e-9, "time/iteration_s": 1.5, "note": "text"},
                           images=images, captions=captions)
    reporter.evaluation(2, Evaluation({"eval/reward_total": 0.3}, [], []))
    reporter.close()

    acc = read_events(tmp_path / "tensorboard")
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    expected: dict[str, list] = {}
    for row in rows:
        for k, v in row.items():
            if k != "iteration" and isinstance(v, float):
                expected.setdefault(k, []).append((row["iteration"], f32(v)))
    expected["eval/reward_total"] = [(0, f32(0.1)), (2, f32(0.3))]
    expected["eval/num"] = [(0, 4.0)]
    assert scalar_series(acc) == expected
    assert sorted(acc.Tags()["images"]) == ["eval/images", "samples"]  # one grid per call, not one tag an image
    assert [e.step for e in acc.Images("samples")] == [2] and [e.step for e in acc.Images("eval/images")] == [0]
    grid = np.asarray(Image.open(io.BytesIO(acc.Images("samples")[0].encoded_image_string)))
    pad = tensorboard_backend.GRID_PADDING
    assert grid.shape == (4 + 2 * pad, 4 * (6 + pad) + pad, 3)  # the four images in one row, padded
    for k in range(4):  # image k at its place in the row, as its caption's number says
        cell = grid[pad:pad + 4, pad + k * (6 + pad):pad + k * (6 + pad) + 6]
        assert (cell == round(k / 7 * 255)).all(), k
    (text,) = acc.Tensors("samples/captions/text_summary")
    assert text.step == 2 and text.tensor_proto.string_val[0].decode() == "  \n".join(
        f"{k:02d}: {c}" for k, c in enumerate(captions))


def test_resume_hides_the_steps_logged_past_the_checkpoint(tmp_path):
    first = TensorBoardBackend(tmp_path)
    for step in (1, 2, 3):
        first.scalars(step, {"reward/total": float(step)})
    first.close()  # a crash after iteration 3 logged; the checkpoint is iteration 1's
    resumed = TensorBoardBackend(tmp_path, start=1)
    for step in (2, 3, 4):
        resumed.scalars(step, {"reward/total": 10.0 * step})
    resumed.close()
    assert scalar_series(read_events(tmp_path / "tensorboard")) == {
        "reward/total": [(1, 1.0), (2, 20.0), (3, 30.0), (4, 40.0)]}


def test_missing_tensorboard_is_one_line_at_preflight(tmp_path):
    code = """
import sys
sys.modules["tensorboard"] = None  # as if not installed: importlib.util.find_spec answers None
from megaflow.cli import main
try:
    rc = main(sys.argv[1:])
finally:
    print("HEAVY=" + ",".join(m for m in ("torch", "megatron", "sglang", "diffusers") if m in sys.modules))
sys.exit(rc)
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    env.pop("WORLD_SIZE", None)
    r = subprocess.run([sys.executable, "-c", code, "train", "-c", str(REPO / "configs" / "cpu_demo.toml"),
                        "--set", "logging.tensorboard=true", "--set", f'run.output_dir="{tmp_path / "runs"}"'],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = r.stderr.splitlines()
    assert "logging.tensorboard = true: the tensorboard package is not installed" in line, line
    assert r.stdout.splitlines() == ["HEAVY="] and not (tmp_path / "runs").exists()
