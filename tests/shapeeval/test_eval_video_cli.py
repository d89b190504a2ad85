"""``megaflow eval video`` end to end. Needs: CPU, 1 process (~10 s; the slow test: the tiny Wan pipeline sampled by
diffusers' WanPipeline and by an SGLang engine, ~2-3 min on 2 cores).

Ground-truth clips written as report/video.py writes them (GIF), as PNG-frame folders and as .npy arrays (uint8, and
float in the rewards' layout) score 1.0, from file names or a manifest; an MP4 reads back with its frames; a static
clip saved as GIF (Pillow merges its equal frames) reads back with all its frames and fails; an image reward per
frame equals the reward on each frame averaged (1e-6); bad input is one line, exit 2."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from megaflow.cli import main
from megaflow.data.video_shapes import parse_video_prompt, sample_video_prompts
from megaflow.report.video import write_video
from megaflow.shapeeval.video_io import load_clip, save_clips
from megaflow.shapeeval.video_render import corrupt_clip, render_video_prompts

PROMPTS = sample_video_prompts("eval", 12, seed=5)


def _run(capsys, *argv) -> tuple[int, dict | None, str]:
    rc = main(["eval", "video", *argv, "--json"])
    out, err = capsys.readouterr()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    return rc, json.loads(lines[-1]) if lines else None, err


def _name(i: int, prompt: str) -> str:
    return f"{i:04d}-" + prompt.replace(" ", "_")


@pytest.fixture(scope="module")
def clips():
    return render_video_prompts(PROMPTS, num_frames=5, seed=1)


def test_ground_truth_folders_score_one(tmp_path, clips, capsys):
    for i, (clip, prompt) in enumerate(zip(clips, PROMPTS)):
        kind = i % 4
        if kind == 0:
            write_video(clip, tmp_path / "names" / f"{_name(i, prompt)}.gif", fps=4)
        elif kind == 1:
            save_clips(clip[None], [prompt], tmp_path / "tmp" / str(i))
            (tmp_path / "tmp" / str(i) / "0000").rename(tmp_path / "names" / _name(i, prompt))
        elif kind == 2:
            np.save(tmp_path / "names" / f"{_name(i, prompt)}.npy", clip)
        else:
            np.save(tmp_path / "names" / f"{_name(i, prompt)}.npy", clip.transpose(0, 3, 1, 2) / np.float32(255))
    rc, result, err = _run(capsys, "--clips", str(tmp_path / "names"), "--frames", "5")
    assert rc == 0, err
    assert result["num"] == 12 and result["accuracy"] == 1.0 and result["partial_mean"] == 1.0
    assert result["ci95"][0] > 0.7 and len(result["per_category"]) == 4
    save_clips(clips, PROMPTS, tmp_path / "manifest")
    rc, result, err = _run(capsys, "--clips", str(tmp_path / "manifest"))
    assert rc == 0 and result["accuracy"] == 1.0 and result["files"][0] == "0000", err


def test_mp4_and_merged_gif_frames_read_back(tmp_path, clips):
    mp4 = write_video(clips[0], tmp_path / "a.mp4", fps=4)
    back = load_clip(mp4, num_frames=5)
    assert back.shape == clips[0].shape and np.abs(back.astype(float) - clips[0]).mean() < 8  # lossy (yuv420p)
    scene = parse_video_prompt(PROMPTS[0])
    static = corrupt_clip(scene, "static", rng=random.Random(0))
    gif = write_video(static, tmp_path / "s.gif", fps=4)
    assert np.array_equal(load_clip(gif, num_frames=5), static)
    from megaflow.shapeeval.video_checker import score_clip
    assert not score_clip(load_clip(gif, num_frames=5), scene).passed


def test_reward_per_frame_is_the_frames_mean(tmp_path, clips, capsys):
    from megaflow.rewards.registry import build_reward
    np.save(tmp_path / f"{_name(0, PROMPTS[0])}.npy", clips[0])
    np.save(tmp_path / f"{_name(1, PROMPTS[1])}.npy", clips[1])
    rc, result, err = _run(capsys, "--clips", str(tmp_path), "--reward", "jpeg_compressibility")
    assert rc == 0, err
    fn = build_reward("jpeg_compressibility")
    want = [float(fn(torch.from_numpy(c).permute(0, 3, 1, 2).float() / 255, [p] * 5).mean())
            for c, p in zip(clips[:2], PROMPTS[:2])]
    got = result["rewards"]["jpeg_compressibility"]
    np.testing.assert_allclose(got["scores"], want, atol=1e-6)
    assert got["masked"] == 0 and abs(got["mean"] - np.mean(want)) < 1e-6 and result["reward_frames"] == "mean"


def test_bad_input_is_one_line(tmp_path, clips, capsys):
    good = tmp_path / "good"
    np.save(good.mkdir() or good / f"{_name(0, PROMPTS[0])}.npy", clips[0])
    bad_shape = tmp_path / "shape"
    np.save(bad_shape.mkdir() or bad_shape / f"{_name(0, PROMPTS[0])}.npy", clips[0][..., 0])
    bad_prompt = tmp_path / "prompt"
    np.save(bad_prompt.mkdir() or bad_prompt / "0000-a_red_circle_dancing.npy", clips[0])
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / f"{_name(0, PROMPTS[0])}.gif").write_bytes(b"GIF89a" + bytes(40))
    pickled = tmp_path / "pickled"
    np.save(pickled.mkdir() or pickled / f"{_name(0, PROMPTS[0])}.npy", np.array([{"a": 1}], dtype=object))
    cases = {
        ("--clips", str(tmp_path / "missing")): "no such directory",
        ("--clips", str(damaged)): "cannot read",
        ("--clips", str(pickled)): "allow_pickle=False",
        ("--clips", str(bad_shape)): "want uint8 [F, H, W, 3]",
        ("--clips", str(bad_prompt)): "not a video ShapeEval prompt",
        ("--clips", str(good), "--frames", "9"): "5 frames, want 9",
        ("--clips", str(good), "--reward", "nope"): "unknown reward 'nope'",
        ("--clips", str(good), "--reward-frames", "last"): "--reward-frames 'last'",
        ("--pipeline", str(tmp_path / "missing")): "not a directory",
        ("--ground-truth", "--frames", "20"): "at most 12 frames",
        ("--ground-truth", "--reward", "jpeg_compressibility"): "use it with --pipeline or --clips",
        (): "needs one of --clips",
    }
    for argv, want in cases.items():
        rc, result, err = _run(capsys, *argv)
        assert rc == 2 and result is None and want in err and err.count("\n") == 1, (argv, err)


@pytest.mark.slow
@pytest.mark.engine
def test_tiny_wan_pipeline_runs_and_scores(tmp_path, tiny_pipeline_tool, capsys):
    torch.set_num_threads(1)
    pipe = tiny_pipeline_tool.make_tiny_pipeline("wan", tmp_path / "wan", seed=0)
    for sampler in ("diffusers", "sglang"):
        out = tmp_path / f"out-{sampler}"
        rc, result, err = _run(capsys, "--pipeline", str(pipe), "--sampler", sampler, "--num", "4", "--steps", "2",
                               "--out", str(out), "--reward", "jpeg_compressibility")
        assert rc == 0, err
        assert result["num"] == 4 and result["num_frames"] == 5 and result["sampler"] == sampler
        assert 0.0 <= result["accuracy"] <= result["partial_mean"] <= 1.0
        assert all(0.0 <= v <= 1.0 for v in result["per_category_partial"].values())
        assert result["rewards"]["jpeg_compressibility"]["masked"] == 0
        rc, again, err = _run(capsys, "--clips", str(out), "--frames", "5")  # the saved clips score the same
        assert rc == 0 and again["partial_mean"] == result["partial_mean"], err
        assert json.loads((out / "result.json").read_text())["passed"] == again["passed"]
