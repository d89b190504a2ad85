"""Config loading, overrides and validation. Needs: CPU, 1 process, no torch."""
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from megaflow.config import ConfigError, dump_config, load_config, save_config

REPO = Path(__file__).resolve().parents[2]


def test_defaults_roundtrip(tmp_path):
    cfg = load_config(None, ["parallel.tp=2", "parallel.sp=true", "rollout.sde_window=[0, 1]",
                             "reward.weights={jpeg_compressibility = 0.5, colour = 2}"])
    path = save_config(cfg, tmp_path / "run")
    again = load_config(path)
    assert again == cfg
    assert again.parallel.tp == 2 and again.parallel.sp is True
    assert again.rollout.sde_window == [0, 1]
    assert again.reward.weights == {"jpeg_compressibility": 0.5, "colour": 2}
    assert not list((tmp_path / "run").glob(".config.*")), "temp file left behind"


@pytest.mark.parametrize("override, needle", [
    ("parallel.tpp=2", "unknown key parallel.tpp"),
    ("nosuch.tp=2", "unknown section 'nosuch'"),
    ("parallel.tp=0", "parallel.tp: value 0 out of range"),
    ("parallel.tp=two", "parallel.tp: expected int, got str 'two'"),
    ("parallel.tp=true", "parallel.tp: expected int, got bool"),
    ("rollout.sde_type=euler", "rollout.sde_type: value 'euler' not one of"),
    ("rollout.noise_level=1.5", "rollout.noise_level: value 1.5 out of range"),
    ("parallel.sp=true", "requires parallel.tp > 1"),
    ("rollout.sde_window=[0, 99]", "rollout.sde_window: step indices [99]"),
    ("parallel", "expected section.key=value"),
])
def test_bad_override_names_key(override, needle):
    with pytest.raises(ConfigError) as ei:
        load_config(None, [override])
    msg = str(ei.value)
    assert needle in msg and "\n" not in msg


def test_file_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlr = -1.0\n")
    with pytest.raises(ConfigError, match=r"bad.toml: train.lr: value -1.0 out of range"):
        load_config(bad)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.toml")


def test_int_promoted_to_float():
    assert load_config(None, ["train.lr=1"]).train.lr == 1.0


def test_shipped_configs_valid():
    files = sorted((REPO / "configs").glob("*.toml"))
    assert files, "configs/ has no run files"
    for f in files:
        cfg = load_config(f)
        assert tomllib.loads(dump_config(cfg))


def test_cli_bad_set_one_line_nonzero():
    r = subprocess.run([sys.executable, "-m", "megaflow.cli", "config", "show", "--set", "parallel.tq=3"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0 and "parallel.tq" in r.stderr
    assert r.stdout == ""


def test_cli_show_resolved():
    r = subprocess.run([sys.executable, "-m", "megaflow.cli", "config", "show", "--set", "parallel.tp=4"],
                       capture_output=True, text=True, cwd=REPO, check=True)
    assert tomllib.loads(r.stdout)["parallel"]["tp"] == 4


def test_config_show_every_shipped_config(capsys, monkeypatch):
    """``megaflow config show`` on every file in configs/: the printed TOML is the loaded config. A config whose
    model.pretrained is not downloaded here (the GPU configs) is shown with --no-files; without it, one line
    naming the first missing file (model.pretrained, or the PickScore configs' data.prompts) and exit 2."""
    from megaflow.cli import main

    monkeypatch.chdir(REPO)
    files = sorted((REPO / "configs").glob("*.toml"))
    assert {"sd3_medium_8xh100.toml", "flux_dev_2x8xh100.toml"} <= {f.name for f in files}
    for f in files:
        cfg = load_config(f)
        missing = bool(cfg.model.pretrained) and not (REPO / cfg.model.pretrained).is_dir()
        assert main(["config", "show", "-c", str(f), *(["--no-files"] if missing else [])]) == 0, f
        assert tomllib.loads(capsys.readouterr().out) == tomllib.loads(dump_config(cfg)), f
        if missing:
            assert main(["config", "show", "-c", str(f)]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and ("model.pretrained" in err or "data.prompts" in err), err


def test_old_bridge_mode_spelling_is_read_with_one_line(tmp_path):
    """bridge.mode = 'colocated' (the name before 'shared_memory') still loads, from a file or --set, saying so in
    one line on stderr; the resolved config holds the new name, and a placement of that name is left alone."""
    old = tmp_path / "old.toml"
    old.write_text('[bridge]\nmode = "colocated"\n[rollout]\nplacement = "colocated"\n')
    for args in (["config", "show", "-c", str(old)], ["config", "show", "--set", 'bridge.mode="colocated"']):
        r = subprocess.run([sys.executable, "-m", "megaflow.cli", *args], capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 0, r.stderr
        assert r.stderr.count("\n") == 1 and "bridge.mode = 'colocated' is deprecated" in r.stderr, r.stderr
        assert "'shared_memory'" in r.stderr
        shown = tomllib.loads(r.stdout)
        assert shown["bridge"]["mode"] == "shared_memory" and shown["rollout"]["placement"] == "colocated"
    assert load_config(old) == load_config(None, ['bridge.mode="shared_memory"'])
    with pytest.raises(ConfigError, match="bridge.mode: value 'colocate' not one of shared_memory"):
        load_config(None, ['bridge.mode="colocate"'])


def test_phased_keys_on_placement_and_staleness():
    assert load_config(None, []).phased
    assert load_config(None, ['bridge.mode="distributed"']).phased  # engines on trainer ranks, whatever the path
    assert not load_config(None, ["train.max_staleness=1"]).phased
    assert not load_config(None, ['rollout.placement="disaggregated"', "rollout.engine_ranks=1",
                                  'bridge.mode="distributed"']).phased
