"""Malformed run dirs, image folders and reward inputs (``train --resume``, ``eval shapes --images``, ``eval reward``)
stop the command at once with ONE line, as test_malformed_inputs.py's rows do (malformed_builders.
check_one_line_exit_2: exit 2, one stderr line naming what is wrong, nothing written, no heavy import). Needs: CPU,
1 process at a time, no torch (~10 s)."""
from __future__ import annotations

import json
import os
import random

import pytest

from malformed_builders import (  # tests/config/malformed_builders.py
    DEEP_JSON, TRAIN, _A, _clip_dir, _elsewhere, _images, _link, _looped_images, _looped_reward_images,
    _lost_config, _png_text_chunk, _read_only, _in_run_dir, _resume_state, _resume_state_text, _reward_images,
    _saved_config, _runs, _text_chunk_reward_images, png_header, check_one_line_exit_2, rng_with,
)


CASES = {
    "run dir: output_dir a file": (lambda t: _runs(t, lambda r: r.write_text("")), "runs': not a directory"),
    "run dir: output_dir read-only": (lambda t: _runs(t, _read_only), "runs': not writable"),
    "run dir: output_dir a dangling symlink": (lambda t: _runs(t, lambda r: _link(r, "nowhere", at="")),
                                               "runs': a dangling symlink"),
    "run dir: a dangling symlink": (lambda t: _runs(t, lambda r: _link(r, "nowhere")), "r is a dangling symlink"),
    "run dir: a symlink outside output_dir": (lambda t: _runs(t, _elsewhere), "outside run.output_dir"),
    "run dir: 300-character name": (lambda t: [*TRAIN, "--set", f'run.name="{"n" * 300}"'], "file name too long"),
    "run dir: resume, config lost, other family": (lambda t: _runs(t, _lost_config, "--resume", "--set",
                                                                   "model.family=flux"),
                                                   "model.family = 'flux' differs from the checkpoint's 'sd3'"),
    "images: missing dir": (lambda t: ["eval", "shapes", "--images", str(t / "nope")], "images dir does not exist"),
    "images: empty dir": (lambda t: _images(t, {}), "no images"),
    "images: not an image": (lambda t: _images(t, {"a_red_circle.png": b"this is text"}), "cannot read image"),
    "images: 20000 x 20000 png": (lambda t: _images(t, {"a_red_circle.png": png_header(20000, 20000)}),
                                  "more than 67108864 pixels (8192 x 8192), refused before decoding"),
    "images: 9000 x 9000 png": (lambda t: _images(t, {"a_red_circle.png": png_header(9000, 9000)}),
                                "refused before decoding (9000 x 9000)"),
    "images: manifest not UTF-8": (lambda t: _images(t, {"manifest.jsonl": b"\xff\xfe{}"}), "manifest.jsonl is not UTF-8"),
    "reward: missing dir": (lambda t: ["eval", "reward", "--reward", "ocr", "--images", str(t / "nope")], "nope: no such directory"),
    "reward: no manifest": (lambda t: _reward_images(t, None), "no manifest.jsonl"),
    "reward: broken jsonl line": (lambda t: _reward_images(t, _A + b'{"file": "a.png",\n'), "manifest.jsonl line 2: not JSON"),
    "reward: line without prompt": (lambda t: _reward_images(t, _A * 2 + b'{"file": "a.png"}\n'), "line 3: needs a non-empty string 'prompt'"),
    "reward: file absent": (lambda t: _reward_images(t, _A + b'{"file": "b.png", "prompt": "x"}\n'), "line 2: image 'b.png' not found"),
    "reward: file outside": (lambda t: _reward_images(t, b'{"file": "../x.png", "prompt": "x"}\n'), "'../x.png' is outside the folder"),
    "reward: unknown name": (lambda t: _reward_images(t, _A, reward="orc"), "unknown reward 'orc'"),
    "reward: malformed path": (lambda t: _reward_images(t, _A, reward="mymod:"), "'pkg.module:callable'"),
    "reward: kwargs a list": (lambda t: _reward_images(t, _A, kwargs="[1, 2]"), "--kwargs: want a JSON object"),
    "reward: clipscore without config.json": (lambda t: _reward_images(t, _A, reward="clipscore", kwargs=json.dumps(
        {"path": str(_clip_dir(t, config=False))})), "--kwargs path: "),
    "reward: imagereward dir without its checkpoint": (lambda t: _reward_images(t, _A, reward="imagereward",
                                                        kwargs=json.dumps({"path": str(_clip_dir(t)),
                                                                           "tokenizer_path": str(t)})),
                                                       "has no ImageReward.pt (not an ImageReward download: "
                                                       "hf download THUDM/ImageReward"),
    "reward: kwargs not JSON": (lambda t: _reward_images(t, _A, kwargs="{threads: 2}"), "--kwargs: not JSON"),
    "run dir: resume, state.json iteration '4'": (lambda t: _runs(t, _resume_state(iteration="4"), "--resume"),
                                                  "iteration = '4': want an integer >= 1"),
    "run dir: resume, negative prompts_consumed": (lambda t: _runs(t, _resume_state(prompts_consumed=-3), "--resume"),
                                                   "prompts_consumed = -3: want an integer >= 0"),
    "run dir: resume, prompts_consumed 10**12": (lambda t: _runs(t, _resume_state(prompts_consumed=10**12), "--resume"),
                                                 "prompts_consumed = 1000000000000, more than the 12 that 2 iter"),
    "run dir: resume, an integer of 5000 digits": (
        lambda t: _runs(t, _resume_state_text('{"iteration": 2, "prompts_consumed": 1' + "0" * 5000 + "}"), "--resume"),
        "state.json: unreadable checkpoint state (ValueError: Exceeds the limit"),
    "run dir: resume, an AWM checkpoint in a flowgrpo run": (lambda t: _runs(t, _resume_state(algorithm="awm"), "--resume"),
                                                             "written by a 'awm' run; algo.name = 'flowgrpo' cannot"),
    "run dir: resume, python RNG word 2**40": (
        lambda t: _runs(t, _resume_state(rng=rng_with(python=repr((3, (2**40, *random.Random(0).getstate()[1][1:]), None)))), "--resume"),
        "rng = [{'python': '(3, (1099511627776,"),
    "run dir: resume, numpy RNG position 10**30": (
        lambda t: _runs(t, _resume_state(rng=rng_with(numpy={2: 10**30})), "--resume"), "as python, numpy and torch give them"),
    "run dir: resume, torch RNG state a number": (
        lambda t: _runs(t, _resume_state(rng=rng_with(torch=7)), "--resume"), "rng = [{'python': "),
    "run dir: resume, a metrics row's reward a string": (
        lambda t: _runs(t, _resume_state(metrics=[{"iteration": 1, "reward/total": "high"}]), "--resume"),
        "metrics = [{'iteration': 1, 'reward/total': 'high'}]: want a list of metrics rows"),
    "run dir: resume, a metrics row a list": (
        lambda t: _runs(t, _resume_state(metrics=[[1, 2]]), "--resume"), "metrics = [[1, 2]]: want a list"),
    "images: a symlink loop": (lambda t: _looped_images(t, manifest=False), "Too many levels of symbolic links"),
    "images: a symlink loop in the manifest": (lambda t: _looped_images(t, manifest=True),
                                               "line 1: image 'a_red_circle.png' cannot be opened"),
    "images: a PNG with a 200 MB text chunk": (lambda t: _images(t, {"a_red_circle.png": _png_text_chunk(200)}),
                                               "a_red_circle.png: ValueError: Decompressed data too large"),
    "reward: a symlink loop": (lambda t: _looped_reward_images(t), "line 2: image 'loop.png' cannot be opened"),
    "reward: a PNG with a 200 MB text chunk": (lambda t: _text_chunk_reward_images(t),
                                               "a.png: ValueError: Decompressed data too large"),
    "reward: unknown colour": (lambda t: _reward_images(t, _A, reward="color_target",
                                                        kwargs='{"target": "purpleish"}'),
                               "--kwargs target: unknown colour 'purpleish'"),
    "reward: kwargs nested 5000 deep": (lambda t: _reward_images(t, _A, kwargs=DEEP_JSON),
                                        "--kwargs: nested too deeply to read"),
    "reward: --timeout-s -1": (lambda t: [*_reward_images(t, _A, reward="jpeg_compressibility"), "--timeout-s", "-1"],
                               "--timeout-s -1.0: want seconds >= 0"),
    "run dir: tensorboard dir a file": (lambda t: _runs(t, _in_run_dir("tensorboard", "file"), "--set",
                                                        "logging.tensorboard=true"),
                                        "logging.tensorboard: "),
    "run dir: wandb dir a file": (lambda t: _runs(t, _in_run_dir("wandb", "file"), "--set", "logging.wandb=true"),
                                  "r/wandb is not a directory (the backend writes there; move it away)"),
    "run dir: wandb_id a directory": (lambda t: _runs(t, _in_run_dir("wandb_id", "dir"), "--set",
                                                      "logging.wandb=true"), "r/wandb_id is not a regular file"),
    "run dir: tensorboard dir a dangling symlink": (lambda t: _runs(t, _in_run_dir("tensorboard", "dangling"),
                                                                    "--set", "logging.tensorboard=true"),
                                                    "r/tensorboard is a dangling symlink"),
    "run dir: tensorboard dir read-only": (lambda t: _runs(t, _in_run_dir("tensorboard", "read-only"), "--set",
                                                           "logging.tensorboard=true"),
                                           "r/tensorboard is not writable"),
    "run dir: resume, config.toml a symlink loop": (lambda t: _runs(t, _saved_config(
        lambda c: c.symlink_to(c.name)), "--resume"), "r/config.toml': too many levels of symbolic links"),
    "run dir: resume, config.toml a FIFO": (lambda t: _runs(t, _saved_config(os.mkfifo), "--resume"),
                                            "config.toml is not a regular file, not the run's saved config"),
    "run dir: config.toml /dev/zero": (lambda t: _runs(t, lambda r: (r / "r").mkdir(parents=True) or (
        r / "r" / "config.toml").symlink_to("/dev/zero")), "config.toml is not a regular file"),
    "run dir: resume, config.toml a section not a table": (lambda t: _runs(t, _saved_config(
        lambda c: c.write_text("run = 3\n")), "--resume"), "config.toml: run is not a table (int)"),
    "run dir: resume, config.toml nested 5000 deep": (lambda t: _runs(t, _saved_config(lambda c: c.write_text(
        "[reward]\nkwargs = { a = " + "[" * 5000 + "]" * 5000 + " }\n")), "--resume"),
                                                      "config.toml: nested too deeply to read"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_input_one_line_exit_2(name, tmp_path):
    build, needle = CASES[name]
    check_one_line_exit_2(build(tmp_path), tmp_path, needle)


def test_table_covers_every_kind_of_input():
    assert sum(k.startswith("images:") for k in CASES) >= 3 and sum(k.startswith("reward:") for k in CASES) >= 6
    assert sum(k.startswith("run dir:") for k in CASES) >= 6
