"""``megaflow eval reward``: the real CLI in a subprocess scores a folder of Pillow-rendered words with the
``ocr`` reward (correct text ~1, a blank image 0, a wrong word low; metadata overriding the prompt's quoted
text), prints per-image lines and the mean, or one JSON object with ``--json``. A reward that fails on every image,
or never returns (``--timeout-s``), is an error of one line, and the processes it started end with the command.
Bad inputs are in tests/config/test_malformed_inputs.py. Needs: CPU, 1 process (RapidOCR on CPU, ~10 s)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from PIL import Image

from megaflow.testing.text_render import render_text, text_fonts

REPO = Path(__file__).resolve().parents[2]


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megaflow.cli", *argv], env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ocr-images")
    font = text_fonts()["pillow-default"](40)
    rows = [("open.png", 'A sign that says "OPEN"', render_text("OPEN", font), {}),
            ("garden.png", "a garden sign", render_text("Garden", font), {"text": "Garden"}),
            ("blank.png", 'A sign that says "TIGER"', Image.new("RGB", (256, 256), (255, 255, 255)), {}),
            ("wrong.png", 'A sign that says "BAKERY"', render_text("ZOO", font), {"seed": 3})]
    with open(d / "manifest.jsonl", "w") as fh:
        for name, prompt, image, meta in rows:
            image.save(d / name)
            fh.write(json.dumps({"file": name, "prompt": prompt, **meta}) + "\n")
            if name == "garden.png":
                fh.write("\n")  # blank lines are skipped
    return d


def test_eval_reward_json(folder):
    r = _cli("eval", "reward", "--reward", "ocr", "--kwargs", '{"threads": 1}', "--images", str(folder), "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out) == {"reward", "files", "scores", "mean", "masked"} and out["reward"] == "ocr"
    assert out["files"] == ["open.png", "garden.png", "blank.png", "wrong.png"] and out["masked"] == 0
    open_, garden, blank, wrong = out["scores"]
    assert open_ >= 0.9 and garden >= 0.9, out  # correct text; garden's target comes from its metadata
    assert blank == 0.0, out
    assert wrong < 0.5, out
    assert out["mean"] == pytest.approx(sum(out["scores"]) / 4)


def test_eval_reward_text(folder):
    r = _cli("eval", "reward", "--reward", "ocr", "--images", str(folder))
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 5, r.stdout
    assert [line.split()[1] for line in lines[:4]] == ["open.png", "garden.png", "blank.png", "wrong.png"]
    assert float(lines[2].split()[0]) == 0.0
    assert lines[-1].startswith("mean ocr: ") and lines[-1].endswith("over 4 of 4 images")


def test_eval_reward_custom_callable_and_masking(tmp_path):
    """A 'pkg.module:callable' reward with kwargs; an image it raises on is null and left out of the mean."""
    (tmp_path / "myreward.py").write_text(
        "import torch\n"
        "def score(images, prompts, metadata, scale=1.0):\n"
        "    if metadata[0].get('bad'):\n"
        "        raise RuntimeError('no')\n"
        "    return torch.tensor([scale * m['value'] for m in metadata])\n")
    d = tmp_path / "imgs"
    d.mkdir()
    with open(d / "manifest.jsonl", "w") as fh:
        for i, meta in enumerate([{"value": 1.0}, {"value": 3.0}, {"bad": True}]):
            Image.new("RGB", (8 + i, 8), (i, 0, 0)).save(d / f"{i}.png")  # sizes differ
            fh.write(json.dumps({"file": f"{i}.png", "prompt": "p", **meta}) + "\n")
    env_path = f"{tmp_path}{os.pathsep}{REPO}"
    env = {**os.environ, "PYTHONPATH": env_path, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "megaflow.cli", "eval", "reward", "--reward", "myreward:score",
                        "--kwargs", '{"scale": 2}', "--images", str(d), "--json"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {
        "reward": "myreward:score", "files": ["0.png", "1.png", "2.png"], "scores": [2.0, 6.0, None], "mean": 4.0,
        "masked": 1}

    # -c CONFIG: the config's one reward (its module beside the config) with its reward.kwargs, --kwargs on top
    conf = tmp_path / "conf"
    conf.mkdir()
    (tmp_path / "myreward.py").rename(conf / "myreward.py")
    (conf / "run.toml").write_text('[reward]\nweights = { "myreward:score" = 1.0 }\n'
                                   'kwargs = { "myreward:score" = { scale = 3.0 } }\n')
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for extra, scale in (((), 3.0), (("--kwargs", '{"scale": 0.5}'), 0.5)):
        r = subprocess.run([sys.executable, "-m", "megaflow.cli", "eval", "reward", "-c", str(conf / "run.toml"),
                            "--images", str(d), "--json", *extra], env=env, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout.strip().splitlines()[-1])["scores"] == [scale, 3 * scale, None]


def test_eval_reward_unreadable_image_is_one_line(tmp_path):
    """A listed file that is no image stops the command before any scoring: exit 2, one line naming it."""
    d = tmp_path / "imgs"
    d.mkdir()
    Image.new("RGB", (8, 8)).save(d / "ok.png")
    (d / "bad.png").write_text("not a png")
    (d / "manifest.jsonl").write_text("".join(json.dumps({"file": f, "prompt": 'say "A"'}) + "\n"
                                              for f in ("ok.png", "bad.png")))
    r = _cli("eval", "reward", "--reward", "jpeg_compressibility", "--images", str(d))
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr[-2000:])
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "cannot read image" in lines[0] and "bad.png" in lines[0], r.stderr[-2000:]


def test_eval_reward_huge_image_refused_from_its_header(tmp_path):
    """A file whose PNG header claims 20000 x 20000 pixels is refused before anything is decoded: exit 2, one
    line naming it (the file holds no pixel data, so the test stays small)."""
    ihdr = b"IHDR" + (20000).to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])
    iend = b"IEND"
    png = b"\x89PNG\r\n\x1a\n" + b"".join(len(c[4:]).to_bytes(4, "big") + c + zlib.crc32(c).to_bytes(4, "big")
                                          for c in (ihdr, iend))
    d = tmp_path / "imgs"
    d.mkdir()
    Image.new("RGB", (8, 8)).save(d / "ok.png")
    (d / "huge.png").write_bytes(png)
    (d / "manifest.jsonl").write_text("".join(json.dumps({"file": f, "prompt": 'say "A"'}) + "\n"
                                              for f in ("ok.png", "huge.png")))
    r = _cli("eval", "reward", "--reward", "jpeg_compressibility", "--images", str(d))
    assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stdout, r.stderr[-2000:])
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "huge.png: more than 67108864 pixels" in lines[0], r.stderr[-2000:]


def test_custom_reward_gets_the_training_tensor_and_nothing_scored_exits_2(tmp_path):
    """A custom reward gets what it gets in training, a float32 tensor [1, 3, H, W] in [0, 1] (here its mean is the
    score, checked against the PNG's own pixels); a reward that scores no image exits 2 with one error line."""
    (tmp_path / "tensorreward.py").write_text(
        "import torch\n"
        "def brightness(images, prompts, metadata):\n"
        "    assert isinstance(images, torch.Tensor) and images.dtype == torch.float32 and images.shape[:2] == (1, 3)\n"
        "    assert 0.0 <= float(images.min()) and float(images.max()) <= 1.0\n"
        "    return images.flatten(1).mean(1)\n"
        "def broken(images, prompts, metadata):\n"
        "    raise RuntimeError('weights not found')\n")
    d = tmp_path / "imgs"
    d.mkdir()
    colours = [(255, 0, 0), (10, 20, 30)]
    with open(d / "manifest.jsonl", "w") as fh:
        for i, rgb in enumerate(colours):
            Image.new("RGB", (6 + i, 5), rgb).save(d / f"{i}.png")
            fh.write(json.dumps({"file": f"{i}.png", "prompt": "p"}) + "\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"}
    def run(name):
        return subprocess.run([sys.executable, "-m", "megaflow.cli", "eval", "reward", "--reward", name, "--images",
                               str(d), "--json"], env=env, capture_output=True, text=True, timeout=300)
    r = run("tensorreward:brightness")
    assert r.returncode == 0, r.stderr[-2000:]
    scores = json.loads(r.stdout.strip().splitlines()[-1])["scores"]
    assert scores == pytest.approx([sum(c) / 3 / 255 for c in colours], abs=1e-6)
    r = run("tensorreward:broken")
    errors = [x for x in r.stderr.splitlines() if x.startswith("megaflow: error")]
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert errors == ["megaflow: error: reward 'tensorreward:broken' scored none of the 2 images (RuntimeError: "
                      "weights not found)"], r.stderr[-2000:]


def _custom(tmp_path: Path, code: str, n: int = 3) -> tuple[Path, dict]:
    """A folder of ``n`` images and a reward module ``myreward`` (``code``) importable by the CLI."""
    (tmp_path / "myreward.py").write_text(code)
    d = tmp_path / "imgs"
    d.mkdir()
    with open(d / "manifest.jsonl", "w") as fh:
        for i in range(n):
            Image.new("RGB", (8, 8), (i, 0, 0)).save(d / f"{i}.png")
            fh.write(json.dumps({"file": f"{i}.png", "prompt": "p"}) + "\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1"}
    return d, env


def test_a_reward_that_fails_on_every_image_is_an_error(tmp_path):
    d, env = _custom(tmp_path, "def score(images, prompts, metadata):\n    raise RuntimeError('model not loaded')\n")
    r = subprocess.run([sys.executable, "-m", "megaflow.cli", "eval", "reward", "--reward", "myreward:score",
                        "--images", str(d)], env=env, capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stderr.splitlines() if x.startswith("megaflow:")]
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert lines == ["megaflow: error: reward 'myreward:score' scored none of the 3 images (RuntimeError: model not "
                     "loaded)"], r.stderr[-2000:]


HANGS = """
import subprocess, time
def score(images, prompts, metadata):
    child = subprocess.Popen(["sleep", "1000"])  # a helper process it starts, then it never returns
    with open({pids!r}, "a") as fh:
        fh.write(f"{{child.pid}}\\n")
    time.sleep(1000)
"""


def test_a_reward_that_never_returns_meets_the_timeout_and_its_children_end(tmp_path):
    import psutil

    pids = tmp_path / "pids.txt"
    d, env = _custom(tmp_path, HANGS.format(pids=str(pids)))
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "megaflow.cli", "eval", "reward", "--reward", "myreward:score",
                        "--images", str(d), "--timeout-s", "3"], env=env, capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stderr.splitlines() if x.startswith("megaflow:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert lines == ["megaflow: error: reward 'myreward:score' scored none of the 3 images (timed out: the folder's "
                     "--timeout-s 3 s ran out)"], r.stderr[-2000:]
    assert time.perf_counter() - t0 < 120
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 1  # the first image's call; the others were never tried after the folder's time ran out
    time.sleep(0.5)
    assert not [p for p in started if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _eval(d: Path, env: dict, *extra: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megaflow.cli", "eval", "reward", "--reward", "myreward:score",
                           "--images", str(d), "--json", *extra], env=env, capture_output=True, text=True,
                          timeout=timeout)


HOSTILE = {  # a custom reward's code -> the one stderr line of `eval reward` (exit 2, nothing on stdout)
    "SystemExit(0)": ("def score(images, prompts, metadata):\n    raise SystemExit(0)\n",
                      "megaflow: error: reward 'myreward:score' scored none of the 3 images (SystemExit: 0)"),
    "GeneratorExit": ("def score(images, prompts, metadata):\n    raise GeneratorExit('gone')\n",
                      "megaflow: error: reward 'myreward:score' scored none of the 3 images (GeneratorExit: gone)"),
    "SystemExit on import": ("raise SystemExit(0)\n",
                             "megaflow: config error: --reward: reward 'myreward:score': importing module 'myreward' "
                             "raised "
                             "SystemExit: 0"),
    "SystemExit when built": ("class score:\n    def __init__(self):\n        raise SystemExit(3)\n",
                              "megaflow: error: reward 'myreward:score': building it raised SystemExit: 3"),
    "a meta tensor": ("import torch\ndef score(images, prompts, metadata):\n"
                      "    return torch.zeros(len(prompts), device='meta')\n",
                      "megaflow: error: reward 'myreward:score' returned a tensor on the meta device (it holds no "
                      "values); a reward returns one number per image"),
    "complex scores": ("import torch\ndef score(images, prompts, metadata):\n"
                       "    return torch.ones(len(prompts), dtype=torch.complex64)\n",
                       "megaflow: error: reward 'myreward:score' returned complex scores (torch.complex64); a reward "
                       "returns one real number per image"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_reward_is_one_line(name, tmp_path):
    code, line = HOSTILE[name]
    d, env = _custom(tmp_path, code)
    r = _eval(d, env)
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, (r.returncode, r.stderr[-2000:])
    assert r.stderr.splitlines() == [line], r.stderr[-2000:]


def test_a_bfloat16_or_float64_score_is_a_score(tmp_path):
    """A floating tensor of any dtype is a valid score, read as float32 (values exact in bfloat16 here)."""
    d, env = _custom(tmp_path, "import torch\ndef score(images, prompts, metadata):\n"
                               "    value = float(images[0, 0, 0, 0]) * 255\n"  # the red channel: 0, 1, 2
                               "    dtype = torch.bfloat16 if value < 2 else torch.float64\n"
                               "    return torch.tensor([0.375 + value], dtype=dtype)\n")
    r = _eval(d, env)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert (out["scores"], out["mean"]) == ([0.375, 1.375, 2.375], 1.375)


def test_failures_on_many_images_are_one_warning_line(tmp_path):
    """A reward failing on half of 40 images (one as SystemExit): one summary line, not a line per image."""
    d, env = _custom(tmp_path, "def score(images, prompts, metadata):\n"
                               "    red = round(float(images[0, 0, 0, 0]) * 255)\n"
                               "    if red == 2:\n        raise SystemExit(1)\n"
                               "    if red % 2 == 0:\n        raise RuntimeError(f'no {red}')\n"
                               "    return [float(red)]\n", n=40)
    r = _eval(d, env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.splitlines() == ["reward myreward:score masked 20 of 40 images (first: 0.png: RuntimeError: "
                                     "no 0)"], r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["scores"] == [float(i) if i % 2 else None for i in range(40)] and out["mean"] == 20.0


def test_a_batch_failure_is_one_warning_line_and_system_exit_a_failure(caplog):
    """In training (score_with_info on a batch): a reward that raises on the batch, then SystemExit on some
    samples, masks those in ONE warning line; KeyboardInterrupt still stops."""
    import logging

    import torch

    from megaflow.rewards.base import last_failure, score_with_info

    def reward(images, prompts, metadata):
        if len(prompts) > 1:
            raise ValueError("batch too large\nsecond line")
        if metadata[0]["i"] % 3 == 0:
            raise SystemExit(0)
        return torch.tensor([float(metadata[0]["i"])], dtype=torch.bfloat16)

    images = torch.zeros(9, 3, 4, 4)
    with caplog.at_level(logging.WARNING, logger="megaflow.rewards"):
        scores, _ = score_with_info(reward, images, ["p"] * 9, [{"i": i} for i in range(9)], name="r")
    assert torch.equal(torch.isnan(scores), torch.tensor([i % 3 == 0 for i in range(9)]))
    assert scores[1] == 1.0 and scores.dtype == torch.float32
    assert [r.getMessage() for r in caplog.records] == [
        "reward r: raised on the batch of 9 (ValueError: batch too large second line), retried per sample; masked "
        "3 of 9 (first: sample 0, prompt 'p': SystemExit: 0)"]
    assert last_failure("r") == "ValueError: batch too large second line"

    def interrupted(images, prompts, metadata):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        score_with_info(interrupted, images, ["p"] * 9, name="k")


LEFTOVERS = """
import subprocess, threading, time
def score(images, prompts, metadata):
    threading.Thread(target=time.sleep, args=(1000,), name="reward-helper").start()  # not a daemon
    subprocess.run(["sh", "-c", "sleep 1000 & echo $! >> {pids}"])  # sh exits: its sleep is orphaned
    return [1.0]
"""


def test_a_reward_leaving_a_thread_and_an_orphan_does_not_outlive_the_command(tmp_path):
    """A reward that starts a non-daemon thread and a double-forked process: the command still ends (with its
    scores and one line naming the thread), and the orphan ends with it."""
    import psutil

    pids = tmp_path / "pids.txt"
    d, env = _custom(tmp_path, LEFTOVERS.format(pids=str(pids)), n=2)
    t0 = time.perf_counter()
    r = _eval(d, env, "--timeout-s", "0", timeout=120)  # on the main thread: its threads are not daemons
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert (out["scores"], out["mean"]) == ([1.0, 1.0], 1.0)
    assert r.stderr.splitlines() == ["megaflow: 2 threads ('reward-helper', 'reward-helper') still running after "
                                     "the command (a reward's?): not waited for"], r.stderr[-2000:]
    assert time.perf_counter() - t0 < 60
    started = [int(p) for p in pids.read_text().split()]
    time.sleep(0.5)
    assert len(started) == 2 and not [p for p in started if psutil.pid_exists(p)
                                      and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
