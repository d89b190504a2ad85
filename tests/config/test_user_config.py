"""What a user meets writing a config: did-you-mean suggestions (keys, sections, rewards, reward arguments, a custom
reward's attribute), custom rewards resolved and bound in preflight, ``megaflow config keys``, ``base = "..."``
inheritance, ``--resume auto``, ``parallel.gpus`` in plan and at launch, and ``import megaflow`` leaving the process
environment alone. Needs: CPU, 1 process, no torch except the reward-argument table check (~10 s)."""
from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megaflow.cli import main
from megaflow.config import ConfigError, MegaflowConfig, dump_config, load_config
from megaflow.config.keys import config_keys, format_keys
from megaflow.config.preflight import preflight
from megaflow.config.reward_check import REWARD_ARGS

REPO = Path(__file__).resolve().parents[2]
CUSTOM = """
def brightness(images, prompts, metadata, scale=1.0):
    return scale * images.flatten(1).mean(1)
"""


def _error(overrides, path=None, command="show") -> str:
    with pytest.raises(ConfigError) as e:
        preflight(load_config(path, overrides), command)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("override, hint", [
    ("train.learning_rate=1e-4", "(did you mean train.lr?)"),
    ("rollout.group_sise=4", "(did you mean rollout.group_size?)"),
    ("train.group_size=4", "(did you mean rollout.group_size?)"),
    ("train.warmup=5", "(did you mean train.warmup_iterations?)"),
    ("trian.lr=1e-4", "unknown section 'trian' (did you mean 'train'?)"),
])
def test_unknown_keys_suggest(override, hint):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert hint in str(e.value) and "\n" not in str(e.value)


def test_unknown_key_without_a_close_one_says_nothing_more():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.zzzz=1"])
    assert str(e.value) == "--set unknown key train.zzzz = 1"


def test_rewards_and_their_arguments_suggest():
    assert "unknown reward 'pickscor' (did you mean 'pickscore'?)" in _error(["reward.weights={pickscor = 1.0}"])
    msg = _error(["reward.weights={pickscore = 1.0}", 'reward.kwargs={pickscore = {model_path = "x"}}'])
    assert msg.startswith("reward.kwargs.pickscore.model_path: reward 'pickscore' has no argument 'model_path'")
    assert "path, processor_path" in msg
    assert "(did you mean 'threads'?)" in _error(["reward.weights={ocr = 1.0}", "reward.kwargs={ocr = {thread = 2}}"])
    assert "(did you mean 'ocr'?)" in _error(["reward.weights={ocr = 1.0}", "reward.kwargs={ocrr = {threads = 2}}"])


def test_custom_reward_resolved_in_preflight(tmp_path, monkeypatch):
    (tmp_path / "user_rewards_38.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    ok = ['reward.weights={"user_rewards_38:brightness" = 1.0}',
          'reward.kwargs={"user_rewards_38:brightness" = {scale = 2.0}}']
    preflight(load_config(None, ok), "show")
    assert "has no attribute 'brightnes' (did you mean 'brightness'?)" in _error(
        ['reward.weights={"user_rewards_38:brightnes" = 1.0}'])
    msg = _error(['reward.weights={"user_rewards_38:brightness" = 1.0}',
                  'reward.kwargs={"user_rewards_38:brightness" = {scal = 2.0}}'])
    assert "cannot be called as fn(images, prompts, metadata, **kwargs)" in msg and "(did you mean 'scale'?)" in msg
    (tmp_path / "user_rewards_38b.py").write_text("raise RuntimeError('needs a GPU')\n")
    assert "importing module 'user_rewards_38b' raised RuntimeError: needs a GPU" in _error(
        ['reward.weights={"user_rewards_38b:fn" = 1.0}'])


def test_reward_argument_table_is_the_registry():
    """REWARD_ARGS (standard library, for preflight) against the constructors themselves (they import torch)."""
    from megaflow.rewards.registry import REWARDS
    got = {}
    for name, factory in REWARDS.items():
        bound = getattr(factory, "keywords", {})  # functools.partial: its bound arguments are no user's
        params = inspect.signature(factory).parameters
        got[name] = tuple(p for p in params if p not in bound and params[p].kind != inspect.Parameter.VAR_KEYWORD)
    assert got == REWARD_ARGS


def test_config_keys_lists_every_field():
    keys = {k.dotted: k for k in config_keys()}
    fresh = MegaflowConfig()
    want = {f"{s.name}.{f.name}" for s in dataclasses.fields(fresh) for f in dataclasses.fields(getattr(fresh, s.name))}
    assert set(keys) == want
    lr = keys["train.lr"]
    assert (lr.type, lr.default, lr.checks) == ("float", 3e-4, "> 0.0") and lr.help == "AdamW learning rate."
    assert keys["rollout.sde_type"].checks == "one of sde, cps, ode"
    assert keys["rollout.group_size"].checks == ">= 2, <= 1024"
    text = format_keys([keys["rollout.group_size"]])
    assert text.splitlines()[0] == "rollout.group_size (int) = 4  [>= 2, <= 1024]"


def test_base_inheritance(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.toml").write_text('[train]\nlr = 1e-3\niterations = 7\n[reward]\nweights = {color_target = 1.0}\n')
    (tmp_path / "sub" / "b.toml").write_text('base = "../a.toml"\n[train]\nlr = 2e-3\n')
    (tmp_path / "c.toml").write_text('base = "sub/b.toml"\n[reward]\nweights = {jpeg_compressibility = 2.0}\n')
    cfg = load_config(tmp_path / "c.toml", ["train.iterations=9"])
    assert (cfg.train.lr, cfg.train.iterations) == (2e-3, 9)
    assert cfg.reward.weights == {"jpeg_compressibility": 2.0}  # a key's value replaces the base's whole
    (tmp_path / "a.toml").write_text('[reward]\nweights = {color_target = 1.0}\nkwargs = {color_target = {target = '
                                     '"red"}}\n')
    assert load_config(tmp_path / "c.toml").reward.kwargs == {}  # c names its own rewards: a's arguments go with a's
    assert load_config(tmp_path / "sub" / "b.toml").reward.kwargs == {"color_target": {"target": "red"}}
    (tmp_path / "c.toml").write_text('base = "sub/b.toml"\n[reward]\nweights = {color_target = 2.0}\n'
                                     'kwargs = {color_target = {target = "blue"}}\n')
    assert load_config(tmp_path / "c.toml").reward.kwargs == {"color_target": {"target": "blue"}}
    (tmp_path / "a.toml").write_text('base = "c.toml"\n')
    with pytest.raises(ConfigError, match=r"makes a cycle \(c.toml -> b.toml -> a.toml -> c.toml\)"):
        load_config(tmp_path / "c.toml")
    (tmp_path / "a.toml").write_text('base = "gone.toml"\n')
    with pytest.raises(ConfigError, match=r"config file not found: .*gone.toml \(the base of .*a.toml\)"):
        load_config(tmp_path / "c.toml")
    (tmp_path / "a.toml").write_text('[train]\nlearning_rate = 1\n')
    with pytest.raises(ConfigError, match=r"^a.toml: unknown key train.learning_rate = 1 \(did you mean train.lr\?\)"):
        load_config(tmp_path / "c.toml")  # the error names the file that holds the key


def test_shipped_variants_build_on_their_base():
    """The shipped variants differ from their base in what their own file sets and nothing else."""
    for variant, base, own in (("shapes_demo_lora", "shapes_demo_flowgrpo", {"run.name", "lora.rank", "lora.alpha",
                                                                            "train.lr", "train.iterations",
                                                                            "train.max_staleness", "train.ema_decay",
                                                                            "algo.clip_range"}),
                               ("cpu_demo_flux", "cpu_demo", {"run.name", "model.family", "rollout.guidance_scale",
                                                              "rollout.max_sequence_length"})):
        a, b = (load_config(REPO / "configs" / f"{n}.toml") for n in (variant, base))
        differ = {f"{s.name}.{f.name}" for s in dataclasses.fields(a) for f in dataclasses.fields(getattr(a, s.name))
                  if getattr(getattr(a, s.name), f.name) != getattr(getattr(b, s.name), f.name)}
        assert differ == own, variant
        assert dump_config(a) != dump_config(b)


def test_resume_auto(tmp_path, capsys):
    from megaflow.cli import _resume_wanted
    cfg = load_config(None, [f'run.output_dir="{tmp_path}"', 'run.name="r"'])
    assert _resume_wanted(cfg, None) is False and _resume_wanted(cfg, "always") is True
    assert _resume_wanted(cfg, "auto") is False and "no checkpoint" in capsys.readouterr().out
    ckpt = tmp_path / "r" / "checkpoints" / "iter_000003"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "state.json").write_text("{}")
    assert _resume_wanted(cfg, "auto") is True and "resuming from iteration 3" in capsys.readouterr().out


def test_plan_takes_the_gpus_from_the_config(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["plan", "-c", str(REPO / "configs" / "sd3_medium_8xh100.toml")]) == 0
    assert "GPUs: 8," in capsys.readouterr().out
    assert main(["plan", "-c", str(REPO / "configs" / "flux_dev_2x8xh100.toml")]) == 0
    assert "GPUs: 16," in capsys.readouterr().out
    assert main(["plan", "-c", str(REPO / "configs" / "flux_dev_2x8xh100.toml"), "--gpus", "8"]) == 0
    assert "GPUs: 8," in capsys.readouterr().out  # --gpus still wins


def test_launch_size_must_match_parallel_gpus(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    cfg = load_config(None, ["parallel.gpus=8"])
    with pytest.raises(ConfigError, match=r"parallel.gpus = 8 but 4 process\(es\) were launched"):
        preflight(cfg, "train")
    preflight(cfg, "show")  # a login node shows it
    with pytest.raises(ConfigError, match="parallel.tp \\* pp \\* cp = 3 does not divide parallel.gpus = 8"):
        preflight(load_config(None, ["parallel.gpus=8", "parallel.tp=3"]), "show")


def test_import_megaflow_leaves_the_environment_alone():
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM")}
    code = ("import os, megaflow, megaflow.cli, megaflow.config, megaflow.rewards, megaflow.models.tiny_pipeline; "
            "print(sorted(k for k in ('HF_HUB_OFFLINE', 'TOKENIZERS_PARALLELISM') if k in os.environ))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]
