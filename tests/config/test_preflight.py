"""megaflow.config.preflight and megaflow.config.files against the code they stand in for: the name tables
equal the (torch-importing) registries, the safetensors header check agrees with the safetensors library
on damaged files, the window checks agree with the controller's, the shipped configs and model pass.
Needs: CPU, 1 process; imports torch and megatron (~10 s)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megaflow.config import ConfigError, load_config
from megaflow.config import files, preflight as pf
from megaflow.families import card

REPO = Path(__file__).resolve().parents[2]


def test_name_tables_equal_the_registries():
    from megaflow.data.shapes import CATEGORIES
    from megaflow.models.provider import BUILTIN_SPECS
    from megaflow.rewards.registry import REWARDS
    from megaflow.trainer.checkpoint import META_FILE

    assert pf.REWARD_NAMES == tuple(REWARDS)
    assert pf.BUILTIN_SPECS == BUILTIN_SPECS
    assert files.CKPT_META == META_FILE
    assert pf.CATEGORIES is CATEGORIES


def test_cuda_detection_agrees_with_torch():
    assert pf.cuda_available() == torch.cuda.is_available()


@pytest.mark.parametrize("path, command", [("cpu_demo.toml", "train"), ("shapes_demo.toml", "demo"),
                                           ("shapes_pretrain.toml", "pretrain"), ("cpu_demo.toml", "show"),
                                           ("cpu_demo_flux.toml", "train")])
def test_shipped_configs_and_model_pass(path, command, monkeypatch):
    monkeypatch.chdir(REPO)  # shapes_demo names assets/shapeeval-sd3 relative to the checkout
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config(REPO / "configs" / path)
    assert pf.preflight(cfg, command) is cfg


def test_pixel_multiple_of_the_shipped_model_is_what_diffusers_computes():
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(REPO / "assets" / "shapeeval-sd3" / "vae")
    tconf = json.loads((REPO / "assets" / "shapeeval-sd3" / "transformer" / "config.json").read_text())
    factor = 2 ** (len(vae.config.block_out_channels) - 1)  # StableDiffusion3Pipeline.vae_scale_factor
    cfg = load_config(REPO / "configs" / "shapes_demo.toml")
    multiple, largest = pf._pixel_multiple(cfg, files.check_pipeline(REPO / "assets" / "shapeeval-sd3", "k"))
    assert multiple == factor * tconf["patch_size"] == 4
    assert largest == tconf["pos_embed_max_size"] * multiple == 64


def test_the_tiny_pipelines_constants_are_its_config(tiny_sd3_dir):
    """preflight knows the tiny SD3 pipeline a run builds without building it: its side multiple and position
    table are the ones of the pipeline megaflow.models.tiny_pipeline writes."""
    configs = files.check_pipeline(tiny_sd3_dir, "k")
    multiple, largest = pf._pixel_multiple(load_config(None, []), configs)
    positions = card("sd3").tiny_positions
    assert (multiple, largest) == (pf.DEFAULT_PIXEL_MULTIPLE, positions * pf.DEFAULT_PIXEL_MULTIPLE)
    assert configs["transformer"]["pos_embed_max_size"] == positions


def _library_accepts(path: Path) -> bool:
    try:
        with safe_open(str(path), "pt") as f:
            for k in f.keys():
                f.get_tensor(k)
        return True
    except Exception:  # the library's own verdict, whatever it raises
        return False


def _damage(blob: bytes, kind: str) -> bytes:
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + n])
    if kind == "truncate_data":
        return blob[:-3]
    if kind == "truncate_header":
        return blob[:8 + n // 2]
    if kind == "short":
        return blob[:5]
    if kind == "append":
        return blob + b"\0" * 4
    if kind == "length_too_big":
        return (len(blob)).to_bytes(8, "little") + blob[8:]
    if kind == "garbage_header":
        return blob[:8] + b"#" * n + blob[8 + n:]
    if kind == "wrong_shape":
        header["a"]["shape"] = [3, 3]
    elif kind == "gap":
        header["b"]["data_offsets"] = [header["b"]["data_offsets"][0] + 4, header["b"]["data_offsets"][1] + 4]
    elif kind == "ok":
        pass
    raw = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    if len(raw) != n:  # keep the header length: re-pad the data section instead
        raise AssertionError("header grew")
    return blob[:8] + raw + blob[8 + n:]


@pytest.mark.parametrize("kind", ["ok", "truncate_data", "truncate_header", "short", "append", "length_too_big",
                                  "garbage_header", "wrong_shape", "gap"])
def test_safetensors_check_agrees_with_the_library(kind, tmp_path):
    good = tmp_path / "good.safetensors"
    save_file({"a": torch.arange(16, dtype=torch.float32).reshape(4, 4), "b": torch.ones(3, dtype=torch.bfloat16)},
              str(good), metadata={"format": "pt"})
    bad = tmp_path / f"{kind}.safetensors"
    bad.write_bytes(_damage(good.read_bytes(), kind))
    accepted = _library_accepts(bad)
    try:
        files.check_safetensors(bad, "key")
        ours = True
    except ConfigError as e:
        ours = False
        assert str(bad) in str(e) and "\n" not in str(e)
    assert ours == accepted, (kind, ours, accepted)
    assert accepted == (kind == "ok")


def test_shipped_pipeline_passes_and_a_truncated_copy_is_named(tmp_path):
    configs = files.check_pipeline(REPO / "assets" / "shapeeval-sd3", "model.pretrained")
    assert configs["transformer"]["_class_name"] == "SD3Transformer2DModel" and "vae" in configs
    copy = shutil.copytree(REPO / "assets" / "shapeeval-sd3", tmp_path / "pipe")
    weights = copy / "text_encoder_2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ConfigError, match=r"model.pretrained: .*text_encoder_2/model.safetensors is truncated"):
        files.check_pipeline(copy, "model.pretrained")


# The window mistakes of tests/trainer/test_grpo_plan.py plus valid settings: preflight and the controller
# (which keeps its own checks) give the same verdict with the same words.
WINDOWS = [
    (["rollout.sde_window_size=2", "rollout.sde_window=[1]"], "set one of them"),
    (["rollout.sde_window_range=[0, 2]"], "needs rollout.sde_window_size > 0"),
    (["rollout.sde_window_size=20"], "rollout.sde_window_size = 20"),
    (["rollout.sde_window_size=2", "rollout.sde_window_range=[3]"], "expected [lo, hi]"),
    (["rollout.sde_window_size=2", "rollout.sde_window_range=[4, 2]"], "rollout.sde_window_size = 2"),
    (["rollout.sde_type=\"cps\"", "rollout.log_prob_no_const=true", "rollout.sde_window_size=1"], "last step alone"),
    (["rollout.sde_type=\"cps\"", "rollout.log_prob_no_const=true", "rollout.sde_window=[9]"], "no trainable step"),
    (["rollout.num_steps=1"], "no trainable step"),
    (["rollout.noise_level=0"], "noise_level=0"),
    (["rollout.sde_window_size=3", "rollout.sde_window_range=[1, 8]"], None),
    (["rollout.sde_type=\"cps\"", "rollout.log_prob_no_const=true", "rollout.sde_window_size=1",
      "rollout.sde_window_range=[0, 5]"], None),
    (["rollout.sde_window=[0, 9]"], None),
    (["rollout.noise_level=0", "rollout.log_prob_no_const=true"], None),
]


@pytest.mark.parametrize("overrides, needle", WINDOWS)
def test_window_checks_agree_with_the_controller(overrides, needle):
    from megaflow.run.flowgrpo import grpo_settings

    cfg = load_config(None, overrides)
    if needle is None:
        pf.preflight(cfg, "show")
        grpo_settings(cfg)
        return
    with pytest.raises(ValueError) as theirs:
        grpo_settings(cfg)
    with pytest.raises(ConfigError) as ours:
        pf.preflight(cfg, "show")
    assert needle in str(theirs.value) and needle in str(ours.value), (str(theirs.value), str(ours.value))


def test_world_size_is_checked_only_for_launches(monkeypatch):
    cfg = load_config(None, ["parallel.tp=2"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    pf.preflight(cfg, "train")
    monkeypatch.setenv("WORLD_SIZE", "3")
    pf.preflight(cfg, "show")
    with pytest.raises(ConfigError, match="does not divide the 3 launched"):
        pf.preflight(cfg, "train")


def test_engine_placement_is_checked_across_fields(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    pf.preflight(load_config(None, ['rollout.engine_hosts="node"']), "train")  # one node is fine
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="4 process\\(es\\) are not whole nodes of 3"):
        pf.preflight(load_config(None, ['rollout.engine_hosts="node"']), "train")
    pf.preflight(load_config(None, ['rollout.engine_hosts="node"']), "show")  # not a launch
    with pytest.raises(ConfigError, match="bridge.mode = 'disk' writes the weights on rank 0 only"):
        pf.preflight(load_config(None, ['rollout.engine_hosts="rank"', 'bridge.mode="disk"']), "show")
    pf.preflight(load_config(None, ['rollout.engine_hosts="rank"', 'bridge.mode="distributed"']), "show")


def test_disaggregated_placement_is_checked_across_fields(monkeypatch):
    dis = ['rollout.placement="disaggregated"', 'rollout.engine_ranks=2', 'bridge.mode="distributed"']
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    pf.preflight(load_config(None, [*dis, "parallel.tp=2"]), "train")  # 2 trainer ranks fit TP=2
    with pytest.raises(ConfigError, match="does not divide the 1 trainer rank"):
        pf.preflight(load_config(None, [*dis[:1], 'rollout.engine_ranks=3', dis[2], "parallel.tp=2"]), "train")
    with pytest.raises(ConfigError, match="needs 1 <= engine_ranks < the 4 launched"):
        pf.preflight(load_config(None, [*dis[:1], 'rollout.engine_ranks=4', dis[2]]), "train")
    with pytest.raises(ConfigError, match="use bridge.mode = 'distributed'"):
        pf.preflight(load_config(None, dis[:2]), "show")
    with pytest.raises(ConfigError, match="needs rollout.engine_ranks >= 1"):
        pf.preflight(load_config(None, [dis[0], dis[2]]), "show")
    with pytest.raises(ConfigError, match="rollout.engine_ranks = 2 is read only"):
        pf.preflight(load_config(None, dis[1:]), "show")
    with pytest.raises(ConfigError, match="rollout.engine_hosts = 'rank' is read only"):
        pf.preflight(load_config(None, [*dis, 'rollout.engine_hosts="rank"']), "show")
    with pytest.raises(ConfigError, match="runs only with bridge.mode = 'shared_memory'"):
        pf.preflight(load_config(None, [*dis, "lora.rank=4"]), "show")


def test_trainer_offload_needs_the_synchronous_loop_with_engines_on_trainer_ranks():
    pf.preflight(load_config(None, ['train.offload="all"']), "show")
    for mode in ("distributed", "disk"):  # phased whatever moves the weights
        pf.preflight(load_config(None, ['train.offload="all"', f'bridge.mode="{mode}"']), "show")
    with pytest.raises(ConfigError, match=r"train.offload = 'optimizer' with rollout.placement = 'colocated', "
                       r"train.max_staleness = 1: .* only while engines on its ranks sample alone"):
        pf.preflight(load_config(None, ['train.offload="optimizer"', "train.max_staleness=1"]), "show")
    with pytest.raises(ConfigError, match=r"train.offload = 'all' with rollout.placement = 'disaggregated'"):
        pf.preflight(load_config(None, ['rollout.placement="disaggregated"', 'rollout.engine_ranks=1',
                                        'bridge.mode="distributed"', 'train.offload="all"']), "show")
    with pytest.raises(ConfigError, match="train.offload"):
        load_config(None, ['train.offload="grads"'])


def test_wandb_without_credentials_is_refused_before_the_run(tmp_path, monkeypatch):
    """logging.wandb with no key (WANDB_API_KEY, or the netrc entry 'wandb login' writes) and no offline
    WANDB_MODE: one line at preflight, before any heavy import (wandb.init would say so only after its timeouts)."""
    from malformed_builders import TRAIN, check_one_line_exit_2
    from megaflow.config.logging_check import check_logging
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    netrc_file = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(netrc_file))
    cfg = load_config(None, ["logging.wandb=true"])
    with pytest.raises(ConfigError, match="no W&B credentials"):
        check_logging(cfg)
    (tmp_path / "cli").mkdir()
    check_one_line_exit_2([*TRAIN, "--set", "logging.wandb=true"], tmp_path / "cli", "no W&B credentials")
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password k\n")
    netrc_file.chmod(0o600)
    check_logging(cfg)  # 'wandb login'
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    with pytest.raises(ConfigError, match="no W&B credentials"):
        check_logging(cfg)  # a key for another host
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_logging(cfg)
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    check_logging(cfg)
