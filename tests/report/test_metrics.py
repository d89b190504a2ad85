"""logging.wandb: wandb.init gets logging.project / entity / tags and no forced mode (wandb decides online or
offline itself); the W&B run id is kept in <run dir>/wandb_id and a resumed run continues it (id, resume="allow");
sample images reach W&B as wandb.Image with their captions, an evaluation's numbers and captioned images reach it at
its step; missing credentials are one line. Needs: CPU, 1
process, no network (a stand-in wandb module records calls; one test runs the real wandb with WANDB_MODE=offline)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from megaflow.config import load_config
from megaflow.report.backends import open_backends
from megaflow.report.metrics import Evaluation, MetricsLog
from megaflow.report.progress import RunReporter
from megaflow.report.wandb_backend import WANDB_ID_FILE

REPO = Path(__file__).resolve().parents[2]


class UsageError(Exception):
    pass


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in ``wandb`` module: ``calls`` records init kwargs, logs, finish and teardown; init hands out run
    ids."""
    calls: list = []

    class Run:
        def __init__(self, run_id):
            self.id = run_id

        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    class Image:
        def __init__(self, data, caption=None):
            self.data, self.caption = data, caption

    def init(**kw):
        calls.append(("init", kw))
        if fake.fail:
            raise UsageError("No API key configured. Use `wandb login` to log in.")
        return Run(kw.get("id", f"run{len(calls)}"))

    def teardown():
        calls.append(("teardown",))

    class Video:
        def __init__(self, data, caption=None, format=None):
            self.data, self.caption, self.format = data, caption, format

    fake = types.ModuleType("wandb")
    fake.init, fake.Image, fake.Video, fake.fail, fake.teardown = init, Image, Video, False, teardown
    fake.errors = types.SimpleNamespace(UsageError=UsageError)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    fake.calls = calls
    return fake


def inits_of(fake) -> list[dict]:
    """The keyword arguments of every ``wandb.init`` call so far."""
    return [c[1] for c in fake.calls if c[0] == "init"]


def _cfg(*overrides: str):
    return load_config(None, ["logging.wandb=true", *overrides])


def _log(run_dir: Path, cfg, start: int = 0) -> MetricsLog:
    return MetricsLog(run_dir, backends=open_backends(run_dir, cfg, start=start))


def test_init_kwargs_from_config_and_no_forced_mode(tmp_path, fake_wandb):
    cfg = _cfg('logging.project="flowrl"', 'logging.entity="my-team"', 'logging.tags=["sd3", "nft"]')
    log = _log(tmp_path / "run-a", cfg)
    log.write(1, {"reward/total": 0.5, "note": "x"})
    log.close()
    (_, kw), *rest = fake_wandb.calls
    assert kw["project"] == "flowrl" and kw["entity"] == "my-team" and kw["tags"] == ["sd3", "nft"]
    assert kw["name"] == "run-a" and kw["dir"] == str(tmp_path / "run-a") and kw["config"]["logging"]["tags"]
    assert "mode" not in kw and "id" not in kw and "resume" not in kw
    assert rest == [("log", 1, {"reward/total": 0.5}), ("finish",), ("teardown",)]  # close waits for wandb's files
    assert (tmp_path / "run-a" / WANDB_ID_FILE).read_text().strip() == "run1"
    assert json.loads((tmp_path / "run-a" / "metrics.jsonl").read_text()) == {"iteration": 1, "note": "x",
                                                                              "reward/total": 0.5}


def test_defaults_leave_entity_to_wandb(tmp_path, fake_wandb):
    _log(tmp_path / "r", _cfg()).close()
    kw = fake_wandb.calls[0][1]
    assert kw["project"] == "megaflow" and kw["tags"] == [] and "entity" not in kw


def test_resume_continues_the_stored_run(tmp_path, fake_wandb):
    run_dir = tmp_path / "r"
    _log(run_dir, _cfg()).close()
    first_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    _log(run_dir, _cfg(), start=1).close()
    inits = inits_of(fake_wandb)
    assert inits[1]["id"] == first_id and inits[1]["resume"] == "allow"
    assert (run_dir / WANDB_ID_FILE).read_text().strip() == first_id
    # a run resumed without a stored id (it ran without wandb before) starts a W&B run and keeps its id
    _log(tmp_path / "other", _cfg(), start=1).close()
    assert "id" not in inits_of(fake_wandb)[-1] and (tmp_path / "other" / WANDB_ID_FILE).is_file()


def test_missing_credentials_are_one_line(tmp_path, fake_wandb):
    fake_wandb.fail = True
    with pytest.raises(ValueError, match=r"^logging.wandb: No API key configured.*WANDB_MODE=offline"):
        _log(tmp_path / "r", _cfg())


def test_reporter_logs_sample_images_with_captions(tmp_path, fake_wandb):
    cfg = _cfg("logging.sample_every=2", "rollout.group_size=2", "rollout.prompts_per_iter=2", "logging.log_every=5")
    reporter = RunReporter(tmp_path, cfg, enabled=True, verbose=False, total_iterations=3)
    images = torch.stack([torch.full((3, 4, 4), k / 4) for k in range(4)])
    for it in (1, 2, 3):
        reporter.iteration(it, {"reward/total": 0.1 * it, "time/iteration_s": 1.0}, images=images,
                           captions=[f"prompt {k} | reward {k / 10:.3f}" for k in range(4)])
    reporter.close()
    media = [(c[1], c[2]["samples"]) for c in fake_wandb.calls if c[0] == "log" and "samples" in c[2]]
    assert [step for step, _ in media] == [2, 3]  # every sample_every and the last, as the grids
    step, imgs = media[0]
    assert [im.caption for im in imgs] == [f"prompt {k} | reward {k / 10:.3f}" for k in range(4)]
    assert imgs[3].data.shape == (4, 4, 3) and imgs[3].data.dtype.name == "uint8" and imgs[3].data[0, 0, 0] == 191
    assert (tmp_path / "samples" / "iter00002.png").is_file()


def test_reporter_logs_video_samples_as_one_mp4(tmp_path, fake_wandb):
    """Clips [F, 3, H, W] reach W&B as one wandb.Video: the MP4 of the grids (5 frames), every caption in order."""
    import imageio.v2 as iio2

    cfg = _cfg("logging.sample_every=1", "rollout.group_size=2", "rollout.fps=8")
    reporter = RunReporter(tmp_path, cfg, enabled=True, verbose=False, total_iterations=1)
    clips = torch.rand(2, 5, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    reporter.iteration(1, {"reward/total": 0.1}, images=list(clips), captions=["a red cat", "a blue dog"])
    reporter.close()
    (video,) = [c[2]["samples"] for c in fake_wandb.calls if c[0] == "log" and "samples" in c[2]]
    assert video.format == "mp4" and video.caption == "a red cat | a blue dog"
    reader = iio2.get_reader(video.data, format="FFMPEG")
    assert reader.count_frames() == 5 and reader.get_meta_data()["fps"] == 8
    assert (tmp_path / "samples" / "iter00001.mp4").is_file()


def test_reporter_logs_evaluations_at_their_step(tmp_path, fake_wandb):
    reporter = RunReporter(tmp_path, _cfg("logging.sample_every=0"), enabled=True, verbose=False, total_iterations=2)
    reporter.iteration(0, {"sync/verified": True, "note": "x"})
    captions = [f"prompt {k} | reward 0.250" for k in range(20)]
    figures = {"eval/reward_total": 0.25, "eval/num": 20, "eval/masked_reward": None, "when": "before"}
    reporter.evaluation(0, Evaluation(figures, [torch.full((3, 4, 4), 0.5)] * 20, captions))
    reporter.iteration(1, {"reward/total": 0.5, "time/iteration_s": 1.0})
    reporter.evaluation(1, Evaluation({"eval/reward_total": 0.5}, [], []))
    reporter.close()
    logs = [(c[1], c[2]) for c in fake_wandb.calls if c[0] == "log"]
    assert [step for step, _ in logs] == [0, 0, 0, 1, 1]  # non-decreasing: an evaluation shares its step
    assert logs[0][1] == {"sync/verified": 1.0} and logs[1][1] == {"eval/reward_total": 0.25, "eval/num": 20.0}
    media = logs[2][1]["eval/images"]
    assert len(media) == 16 and [m.caption for m in media] == captions[:16]
    assert media[0].data.shape == (4, 4, 3) and media[0].data[0, 0, 0] == 128  # 127.5 rounds as the grids do
    assert logs[4][1] == {"eval/reward_total": 0.5}


def test_real_wandb_offline_resume(tmp_path):
    """The real wandb in offline mode (no network): the run id is stored, and a resumed log reuses it."""
    code = """
import sys
from pathlib import Path
from megaflow.config import load_config
from megaflow.report.backends import open_backends
from megaflow.report.metrics import MetricsLog
cfg = load_config(None, ["logging.wandb=true", 'logging.tags=["t1"]'])
run_dir, step = Path(sys.argv[1]), int(sys.argv[3])
log = MetricsLog(run_dir, backends=open_backends(run_dir, cfg, start=step - 1 if sys.argv[2] == "1" else 0))
log.write(step, {"reward/total": 0.5})
print("ID=" + log.backends[0].run.id)
log.close()
"""
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path),
           "WANDB_SILENT": "true", "HOME": str(tmp_path)}
    env.pop("WANDB_API_KEY", None)
    ids = []
    for resume, step in (("0", 1), ("1", 2)):
        r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run"), resume, str(step)], env=env,
                           capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr[-2000:]
        ids.append([x[3:] for x in r.stdout.splitlines() if x.startswith("ID=")][0])
    assert ids[0] == ids[1] == (tmp_path / "run" / "wandb_id").read_text().strip()
    assert list((tmp_path / "run" / "wandb").glob(f"offline-run-*-{ids[0]}"))


@pytest.mark.parametrize("name, kind, setting, line", [
    ("tensorboard", "file", "logging.tensorboard=true", "logging.tensorboard: {d}/tensorboard is not a directory"),
    ("wandb", "file", "logging.wandb=true", "logging.wandb: {d}/wandb is not a directory"),
    ("wandb_id", "dir", "logging.wandb=true", "logging.wandb: {d}/wandb_id is not a regular file"),
    ("tensorboard", "read-only", "logging.tensorboard=true", "logging.tensorboard: {d}/tensorboard is not writable"),
    ("wandb", "read-only", "logging.wandb=true", "logging.wandb: {d}/wandb is not writable"),
])
def test_an_unusable_backend_path_is_one_line_before_any_backend_opens(tmp_path, fake_wandb, monkeypatch, name,
                                                                       kind, setting, line):
    """What a backend writes in the run dir, there as a file, a directory or read-only: one line (ConfigError)
    from open_backends, nothing opened (read-only is the OS's answer, stood in for: this may run as root)."""
    from megaflow.config import ConfigError
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = run_dir / name
    path.write_text("x") if kind == "file" else path.mkdir()
    if kind == "read-only":
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **k: Path(p) != path and real(p, mode, **k))
    with pytest.raises(ConfigError) as e:
        open_backends(run_dir, _cfg(setting))
    assert str(e.value).startswith(line.format(d=run_dir)) and not inits_of(fake_wandb)
