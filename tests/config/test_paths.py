"""Paths in a run file are read relative to that file (megaflow.config.paths): a shipped config loads the same
from any directory; ``--set`` paths stay relative to the working directory; a path that exists only under the
working directory is still read there with a one-line note; a custom reward module beside the config is found
without PYTHONPATH. Reference: the paths written by hand in the test. Needs: CPU, no torch (< 2 s)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megaflow.config import load_config

REPO = Path(__file__).resolve().parents[2]


def test_a_shipped_config_reads_the_same_files_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(REPO / "configs" / "cpu_ocr.toml")
    assert Path(cfg.data.prompts).resolve() == REPO / "assets" / "text_prompts" / "train.jsonl"
    assert Path(cfg.data.test_prompts).is_file()
    demo = load_config(os.path.relpath(REPO / "configs" / "shapes_demo.toml"))
    assert Path(demo.model.pretrained).resolve() == REPO / "assets" / "shapeeval-sd3"
    assert demo.data.prompts == "shapes"  # a special word, not a path
    monkeypatch.chdir(REPO)
    assert load_config("configs/shapes_demo.toml").model.pretrained == "assets/shapeeval-sd3"  # as before the rule


def test_set_paths_stay_with_the_working_directory_and_old_configs_still_load(tmp_path, monkeypatch, capsys):
    (tmp_path / "conf").mkdir()
    (tmp_path / "prompts.txt").write_text("a red circle\n")
    (tmp_path / "conf" / "run.toml").write_text('[data]\nprompts = "prompts.txt"\n'
                                                '[reward]\nweights = { pickscore = 1.0 }\n'
                                                'kwargs = { pickscore = { path = "m/ps", device = "cpu" } }\n')
    (tmp_path / "conf" / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = load_config("conf/run.toml")
    assert cfg.data.prompts == "prompts.txt"  # only under the working directory: read there, with a note
    assert cfg.reward.kwargs["pickscore"]["path"] == os.path.join("conf", "m", "ps")  # beside the file
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "data.prompts = 'prompts.txt' is read relative to the working directory" in err
    assert "'../prompts.txt'" in err
    assert load_config("conf/run.toml", ["data.prompts=other.txt"]).data.prompts == "other.txt"


def test_a_reward_module_beside_the_config_is_found_without_pythonpath(tmp_path):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "myrewards.py").write_text("def brightness(images, prompts, metadata):\n"
                                       "    return images.mean(dim=(1, 2, 3))\n")
    (conf / "run.toml").write_text('[reward]\nweights = { "myrewards:brightness" = 1.0 }\n')
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "megaflow.cli", "config", "show", "-c", str(conf / "run.toml")],
                       cwd=REPO.parent, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert '"myrewards:brightness"' in r.stdout
