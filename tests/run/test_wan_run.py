"""A tiny ``megaflow train`` of the Wan family on CPU (needs: engine; ~1-2 min): 5-frame clips sampled by the
embedded SGLang engine from the tiny Wan pipeline built for the run, scored whole by a reward that takes video
(``reward.frames = "video"``: it gets [B, F, 3, H, W] float32 in [0, 1], and writes down what it got), trained by
FlowGRPO (the trainer's recomputed log-probs of the clips equal the engine's within 1e-5: log-probs are means
over a clip's elements, of order 1), the weights synced and verified, evaluated on test prompts before and after;
the samples and the evaluation grids are MP4s of 5 frames at rollout.fps."""
from __future__ import annotations

import json
import subprocess

import imageio.v2 as iio2
import pytest

from reward_runs import train_with_reward  # tests/run/reward_runs.py

pytestmark = [pytest.mark.engine, pytest.mark.slow]

REWARD = '''
import json, os
import torch

def clip_brightness(videos, prompts, metadata):
    with open(os.path.join(os.path.dirname(__file__), "seen.jsonl"), "a") as f:
        f.write(json.dumps(dict(shape=list(videos.shape), dtype=str(videos.dtype), lo=float(videos.min()),
                                hi=float(videos.max()))) + "\\n")
    return videos.flatten(1).mean(dim=1)

clip_brightness.takes_video = True
'''


def test_wan_trains_on_clips(tmp_path):
    (tmp_path / "video_reward.py").write_text(REWARD)
    (tmp_path / "test_prompts.txt").write_text("a red circle\na blue square\n")
    cmd, env = train_with_reward(tmp_path, "wan", "video_reward:clip_brightness", [
        "model.family=wan", "rollout.num_frames=5", "rollout.fps=8", 'reward.frames="video"', "train.iterations=1",
        "logging.sample_every=1", "eval.every=1", f'data.test_prompts="{tmp_path / "test_prompts.txt"}"'])
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert seen and all(s["shape"] == [2, 5, 3, 32, 32] and s["dtype"] == "torch.float32" for s in seen)
    assert all(0 <= s["lo"] <= s["hi"] <= 1 for s in seen)
    run_dir = tmp_path / "runs" / "wan"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r["iteration"] == 1 and "sync/verified" in r]
    assert row["sync/verified"] == 1.0 and row["sync/tensors"] > 0
    assert row["train/logp_abs_diff_rollout"] <= 1e-5  # the engine's per-step log-probs = the trainer's recompute
    for video in (run_dir / "samples" / "iter00001.mp4", run_dir / "eval" / "iter00000.mp4",
                  run_dir / "eval" / "iter00001.mp4"):  # samples; the evaluation before and after training
        reader = iio2.get_reader(video, format="FFMPEG")
        assert reader.count_frames() == 5 and reader.get_meta_data()["fps"] == 8, video
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["when"] for e in evals] == ["before", "after"] and all(e["eval/reward_total"] > 0 for e in evals)
