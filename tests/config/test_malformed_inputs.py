"""Malformed inputs stop every command at once with ONE line: the real CLI (and tools/convert_checkpoint.py)
run as a subprocess in a temp dir for each row of a table of broken config files, ``--set`` values, prompt
files, pipelines, checkpoints, image folders and run dirs. Each must exit with code 2, print exactly one
non-empty stderr line holding the expected text (naming the key or file), no traceback, nothing on stdout,
write nothing (every file in the temp dir byte-identical; ``run.output_dir`` is never created unless the row
made it), and never import torch, megatron, sglang, diffusers or transformers. Needs: CPU, 1 process at a
time, no torch (~10 s)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from megaflow.config.preflight import cuda_available

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "assets" / "shapeeval-sd3"
HEAVY = ("torch", "megatron", "sglang", "diffusers", "transformers")
# Runs the entry point exactly as its __main__ does, then reports which heavy packages got imported.
WRAPPER = """
import importlib.util, sys
target, argv = sys.argv[1], sys.argv[2:]
if target == "cli":
    from megaflow.cli import main
else:
    spec = importlib.util.spec_from_file_location("convert_checkpoint", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    main = module.main
try:
    rc = main(argv)
finally:
    print("HEAVY=" + ",".join(m for m in %r if m in sys.modules))
sys.exit(rc)
""" % (HEAVY,)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]], *, cut: int = 0) -> None:
    """A safetensors file written with the standard library (zero-filled data); ``cut`` drops trailing bytes."""
    size = {"F32": 4, "F16": 2}
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = size[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    blob = len(raw).to_bytes(8, "little") + raw + bytes(offset)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob[:len(blob) - cut])


def fake_pipeline(root: Path, *, shards: int = 0) -> Path:
    """A diffusers SD3 pipeline layout with the shipped model's configs and small, well-formed weights."""
    root.mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({
        "_class_name": "StableDiffusion3Pipeline", "transformer": ["diffusers", "SD3Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"], "text_encoder_3": [None, None]}))
    for comp in ("transformer", "vae"):
        (root / comp).mkdir()
        (root / comp / "config.json").write_text((SHIPPED / comp / "config.json").read_text())
    write_safetensors(root / "vae" / "diffusion_pytorch_model.safetensors", {"w": ("F32", [4, 4])})
    t = root / "transformer"
    if not shards:
        write_safetensors(t / "diffusion_pytorch_model.safetensors", {"a": ("F32", [8, 8]), "b": ("F16", [3])})
        return root
    weight_map = {}
    for i in range(1, shards + 1):
        name = f"diffusion_pytorch_model-{i:05d}-of-{shards:05d}.safetensors"
        write_safetensors(t / name, {f"w{i}": ("F32", [16, 16])})
        weight_map[f"w{i}"] = name
    (t / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root


def fake_megatron_checkpoint(root: Path) -> Path:
    """The files of a megaflow dist checkpoint that are checked before torch loads it."""
    root.mkdir(parents=True)
    (root / "megaflow_model.json").write_text(json.dumps({"format": 1, "family": "sd3", "diffusers_config": {}}))
    (root / ".metadata").write_bytes(b"\x80\x04")
    (root / "__0_0.distcp").write_bytes(bytes(64))
    return root


# --- the inputs: each builds its files in tmp and returns the command line (after `python -m megaflow.cli`,
# or "tool" + tools/convert_checkpoint.py arguments).

def _cfg(tmp: Path, text: str) -> Path:
    (tmp / "run.toml").write_bytes(text.encode("latin-1") if "\xe9" in text else text.encode())
    return tmp / "run.toml"


def _prompts(tmp: Path, data: bytes | None, *, as_dir: bool = False, name: str = "prompts.txt",
             size: int = 0) -> list[str]:
    path = tmp / name
    if as_dir:
        path.mkdir()
    elif size:  # a sparse file: no disk written, no memory used
        with open(path, "wb") as fh:
            fh.truncate(size)
    elif data is not None:
        path.write_bytes(data)
    return ["--set", f'data.prompts="{path}"']


def _test_prompts(tmp: Path, data: bytes | None, name: str = "held.txt") -> list[str]:
    if data is not None:
        (tmp / name).write_bytes(data)
    return ["--set", f'data.test_prompts="{tmp / name}"']


def _pipe_dir(tmp: Path, damage=None, *, shards: int = 0) -> Path:
    root = fake_pipeline(tmp / "pipe", shards=shards)
    if damage:
        damage(root)
    return root


def _pipe(tmp: Path, damage=None, *, shards: int = 0) -> list[str]:
    return ["--set", f'model.pretrained="{_pipe_dir(tmp, damage, shards=shards)}"']


def _truncate(path: Path, keep: int | None = None, cut: int = 0) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep is not None else data[:len(data) - cut])


def _tool(tmp: Path, command: str, src: Path) -> list[str]:
    return ["tool", command, "--src", str(src), "--dst", str(tmp / "converted")]


def _transformer(tmp: Path, damage=None, *, shards: int = 0) -> Path:
    t = fake_pipeline(tmp / "pipe", shards=shards) / "transformer"
    if damage:
        damage(t)
    return t


def png_header(width: int, height: int) -> bytes:
    """A PNG that claims width x height RGB pixels and holds none (signature, IHDR, IEND): what a reader sees
    before it decodes anything."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")
    ihdr = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def _images(tmp: Path, files: dict[str, bytes]) -> list[str]:
    d = tmp / "images"
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    return ["eval", "shapes", "--images", str(d)]


def _reward_images(tmp: Path, manifest: bytes | None, *, reward: str = "ocr", kwargs: str | None = None) -> list[str]:
    """``megaflow eval reward`` on a folder holding one real PNG (a.png) and ``manifest`` (None: no manifest)."""
    d = tmp / "images"
    d.mkdir()
    (d / "a.png").write_bytes(bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010802000000907753de"
                                            "0000000c4944415408d763f8ffff3f0005fe02fea7d6a4a00000000049454e44ae426082"))
    if manifest is not None:
        (d / "manifest.jsonl").write_bytes(manifest)
    return ["eval", "reward", "--reward", reward, "--images", str(d), *(["--kwargs", kwargs] if kwargs else [])]


def _clip_dir(tmp: Path, *, config: bool = True) -> Path:
    """A folder that looks like a CLIP model directory to the checks (config files only, no weights)."""
    d = tmp / "clip"
    d.mkdir()
    (d / "preprocessor_config.json").write_text("{}")
    if config:
        (d / "config.json").write_text("{}")
    return d


def _imagereward_dir(tmp: Path) -> Path:
    """A folder that looks like an ImageReward download to the checks (a dummy checkpoint, no weights)."""
    d = tmp / "imagereward"
    d.mkdir()
    (d / "ImageReward.pt").write_bytes(b"not read by the checks")
    (d / "med_config.json").write_text("{}")
    return d


# --- run dirs: each row's run is `train` with run.name = "r" in <tmp>/runs (the harness sets run.output_dir).

def _runs(tmp: Path, make=None, *extra: str) -> list[str]:
    """``train`` of run "r" after ``make(<tmp>/runs)`` (None: no runs folder)."""
    if make is not None:
        make(tmp / "runs")
    return [*TRAIN, "--set", 'run.name="r"', *extra]


def _read_only(runs: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes into a chmod 0o555 folder; tests/run/test_rundir.py covers an unwritable one")
    runs.mkdir()
    runs.chmod(0o555)


def _link(runs: Path, target: str, *, at: str = "r") -> None:
    """``runs/<at>`` a symlink to ``runs/../<target>`` (``at`` = "": ``runs`` itself is the link)."""
    link = runs / at if at else runs
    link.parent.mkdir(exist_ok=True)
    link.symlink_to(runs.parent / target)


def _lost_config(runs: Path) -> None:
    """A run dir as a run of model.family sd3 left it at iteration 2, its config.toml lost."""
    ckpt = runs / "r" / "checkpoints" / "iter_000002"
    (ckpt / "model").mkdir(parents=True)
    (ckpt / "model" / "megaflow_model.json").write_text(json.dumps({"format": 1, "family": "sd3"}))
    (ckpt / "state.json").write_text(json.dumps({**STATE, "iteration": 2}))
    (runs / "r" / "metrics.jsonl").write_text('{"iteration": 1}\n{"iteration": 2}\n')


def _elsewhere(runs: Path) -> None:
    (runs.parent / "elsewhere").mkdir()
    _link(runs, "elsewhere")


# A state.json as megaflow.run.state.save writes it (one rank's RNG states cut short: only their types are read).
STATE = {"iteration": 2, "prompts_consumed": 0, "rng": [{"python": "(3, (1, 2), None)", "torch": "",
                                                         "numpy": ["MT19937", "", 0, 0, 0.0]}],
         "metrics": [], "layout": {"tp": 1, "pp": 1}}


def _resume_state(**changes):
    """A run dir at iteration 2 (config lost) whose state.json has ``changes``."""
    def make(runs: Path) -> None:
        _lost_config(runs)
        (runs / "r" / "checkpoints" / "iter_000002" / "state.json").write_text(json.dumps({**STATE, **changes}))
    return make


def _png_text_chunk(megabytes: int) -> bytes:
    """A 1x1 PNG with a zTXt chunk that inflates to ``megabytes`` MB (compressed in pieces: little memory)."""
    png = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010802000000907753de0000000c4944415408d763"
                        "f8ffff3f0005fe02fea7d6a4a00000000049454e44ae426082")
    z = zlib.compressobj()
    text = b"".join(z.compress(b"x" * (1 << 20)) for _ in range(megabytes)) + z.flush()
    data = b"comment\x00\x00" + text
    chunk = len(data).to_bytes(4, "big") + b"zTXt" + data + zlib.crc32(b"zTXt" + data).to_bytes(4, "big")
    return png[:33] + chunk + png[33:]


def _loop(directory: Path, name: str) -> None:
    """``directory/name`` a symlink to itself (a loop)."""
    directory.mkdir(exist_ok=True)
    (directory / name).symlink_to(name)


def _looped_images(tmp: Path, *, manifest: bool) -> list[str]:
    _loop(tmp / "images", "a_red_circle.png")
    if manifest:
        (tmp / "images" / "manifest.jsonl").write_text('{"file": "a_red_circle.png", "prompt": "a red circle"}\n')
    return ["eval", "shapes", "--images", str(tmp / "images")]


def _text_chunk_reward_images(tmp: Path) -> list[str]:
    argv = _reward_images(tmp, _A, reward="jpeg_compressibility")
    (tmp / "images" / "a.png").write_bytes(_png_text_chunk(200))
    return argv


DEEP_JSON = '{"a": ' + "[" * 5000 + "]" * 5000 + "}"


def _looped_reward_images(tmp: Path) -> list[str]:
    argv = _reward_images(tmp, _A + b'{"file": "loop.png", "prompt": "x"}\n', reward="jpeg_compressibility")
    _loop(tmp / "images", "loop.png")
    return argv


_A = b'{"file": "a.png", "prompt": "say \\"A\\""}\n'
TRAIN = ["train", "-c", str(REPO / "configs" / "cpu_demo.toml")]
SHOW = ["config", "show", "-c", str(REPO / "configs" / "cpu_demo.toml")]
DEMO = ["demo", "-c", str(REPO / "configs" / "shapes_demo.toml"), "--set", f'model.pretrained="{SHIPPED}"']
T = "transformer/diffusion_pytorch_model.safetensors"
AWM = ["--set", "algo.name=awm", "--set", "rollout.sde_type=ode"]
DGPO = ["--set", "algo.name=dgpo", "--set", "rollout.sde_type=ode"]

CASES = {
    # config files and --set values
    "config file missing": (lambda t: ["config", "show", "-c", str(t / "missing.toml")], "missing.toml"),
    "config not TOML": (lambda t: ["train", "-c", str(_cfg(t, "[run\nname = 1"))], "invalid TOML"),
    "config not UTF-8": (lambda t: ["config", "show", "-c", str(_cfg(t, '[run]\nname = "caf\xe9"\n'))], "not a UTF-8"),
    "config unknown section": (lambda t: ["train", "-c", str(_cfg(t, "[runn]\nname = 'x'\n"))], "unknown section 'runn'"),
    "lr = inf": (lambda t: [*TRAIN, "--set", "train.lr=inf"], "train.lr: value inf is not a finite number"),
    "lr = nan in file": (lambda t: ["config", "show", "-c", str(_cfg(t, "[train]\nlr = nan\n"))], "train.lr: value nan"),
    "nan reward weight": (lambda t: [*SHOW, "--set", "reward.weights={color_target = nan}"], "reward.weights.color_target"),
    "sde_window of bools": (lambda t: [*TRAIN, "--set", "rollout.sde_window=[true]"], "rollout.sde_window: expected a list of int"),
    "sde_window_range floats": (lambda t: [*SHOW, "--set", "rollout.sde_window_range=[0.5, 3]"], "rollout.sde_window_range: expected a list of int"),
    "sde_window_range one value": (lambda t: [*TRAIN, "--set", "rollout.sde_window_size=2", "--set", "rollout.sde_window_range=[3]"], "expected [lo, hi]"),
    "window and window_size": (lambda t: [*TRAIN, "--set", "rollout.sde_window=[1]", "--set", "rollout.sde_window_size=2"], "set one of them"),
    "window larger than range": (lambda t: [*SHOW, "--set", "rollout.sde_window_size=3", "--set", "rollout.sde_window_range=[0, 2]"], "rollout.sde_window_size = 3"),
    "no trainable step": (lambda t: [*TRAIN, "--set", "rollout.num_steps=1"], "no trainable step"),
    "nft with SDE rollouts": (lambda t: [*DEMO, "--set", "rollout.sde_type=sde"], "set rollout.sde_type = 'ode'"),
    "nft with an SDE window": (lambda t: [*DEMO, "--set", "rollout.sde_window_size=2"], "are FlowGRPO's"),
    "nft timesteps beyond the grid": (lambda t: [*DEMO, "--set", "algo.nft_num_timesteps=11"],
                                      "algo.nft_num_timesteps = 11 exceeds rollout.num_steps = 10"),
    "nft with CFG": (lambda t: [*DEMO, "--set", "rollout.guidance_scale=4.5"], "turns on CFG"),
    "awm with SDE rollouts": (lambda t: [*TRAIN, "--set", "algo.name=awm"],
                              "algo.name = 'awm' trains on clean ODE samples: set rollout.sde_type = 'ode'"),
    "awm with CFG": (lambda t: [*TRAIN, *AWM, "--set", "rollout.guidance_scale=4.5"], "algo.name = 'awm' samples"),
    "awm timesteps beyond the strata": (lambda t: [*TRAIN, *AWM, "--set", "algo.awm_num_timesteps=3"],
                                        "algo.awm_num_timesteps = 3 needs at most"),
    "awm with theta_old's flat steps": (lambda t: [*TRAIN, *AWM, "--set", "algo.old_decay_flat_steps=5"],
                                        "algo.old_decay_flat_steps = 5 is DiffusionNFT's"),
    "dgpo with an SDE window": (lambda t: [*TRAIN, *DGPO, "--set", "rollout.sde_window_size=2"], "are FlowGRPO's"),
    "dgpo with minibatches": (lambda t: [*TRAIN, *DGPO, "--set", "train.num_minibatches=2"],
                              "algo.name = 'dgpo' makes one optimizer step per rollout batch"),
    "dgpo timesteps beyond trunc_steps": (lambda t: [*TRAIN, *DGPO, "--set", "algo.dgpo_trunc_steps=1", "--set",
                                                     "algo.dgpo_num_timesteps=3"],
                                          "algo.dgpo_num_timesteps = 3 exceeds the 2 grid indices"),
    "dgpo trunc_steps beyond the grid": (lambda t: [*TRAIN, *DGPO, "--set", "algo.dgpo_trunc_steps=4"],
                                         "algo.dgpo_trunc_steps = 4 must be < rollout.num_steps = 4"),
    "num_steps = 10**20": (lambda t: [*TRAIN, "--set", f"rollout.num_steps={10**20}"],
                           f"rollout.num_steps: value {10**20} out of range (must be <= 1000)"),
    "num_steps = 1e8": (lambda t: [*TRAIN, "--set", "rollout.num_steps=100000000"], "rollout.num_steps: value 100000000"),
    "seed = 10**20": (lambda t: [*TRAIN, "--set", f"run.seed={10**20}"], "run.seed: value 100000000000000000000 out"),
    "height 16384": (lambda t: [*SHOW, "--set", "rollout.height=16384"], "rollout.height: value 16384 out of range"),
    "plan --gpus -4": (lambda t: ["plan", "-c", SHOW[3], "--gpus", "-4"], "--gpus -4: must be a GPU count"),
    "plan --gpu-mem-gb nan": (lambda t: ["plan", "-c", SHOW[3], "--gpu-mem-gb", "nan"], "--gpu-mem-gb nan: must be"),
    "plan --gpu-mem-gb -1": (lambda t: ["plan", "-c", SHOW[3], "--gpu-mem-gb", "-1"], "--gpu-mem-gb -1.0: must be"),
    "unknown algorithm": (lambda t: [*SHOW, "--set", 'algo.name="ppo"'], "algo.name"),
    "unknown lr schedule": (lambda t: [*SHOW, "--set", 'train.lr_schedule="linear"'], "train.lr_schedule"),
    "ema_decay of 1": (lambda t: [*SHOW, "--set", "train.ema_decay=1.0"], "train.ema_decay"),
    "run.name with ..": (lambda t: [*TRAIN, "--set", 'run.name="../escape"'], "run.name = '../escape'"),
    "run.name empty": (lambda t: [*TRAIN, "--set", 'run.name=""'], "run.name = ''"),
    "run.name hidden": (lambda t: [*TRAIN, "--set", 'run.name=".hidden"'], "run.name = '.hidden'"),
    "context parallel": (lambda t: [*TRAIN, "--set", "parallel.cp=2"], "parallel.cp = 2"),
    "tp without torchrun": (lambda t: [*TRAIN, "--set", "parallel.tp=2"], "WORLD_SIZE"),
    "disk bridge on several hosts": (lambda t: [*TRAIN, "--set", "bridge.mode=disk",
                                                "--set", "rollout.engine_hosts=node"],
                                     "bridge.mode = 'disk' writes the weights on rank 0 only"),
    "disaggregated without distributed bridge": (lambda t: [*SHOW, "--set", "rollout.placement=disaggregated",
                                                            "--set", "rollout.engine_ranks=1"],
                                                 "engine-only ranks hold no trainer weights"),
    "engine_ranks without disaggregated": (lambda t: [*TRAIN, "--set", "rollout.engine_ranks=1"],
                                           "rollout.engine_ranks = 1 is read only"),
    "disaggregated in one process": (lambda t: [*TRAIN, "--set", "rollout.placement=disaggregated", "--set",
                                                "rollout.engine_ranks=1", "--set", "bridge.mode=distributed"],
                                     "needs 1 <= engine_ranks < the 1 launched process(es)"),
    "engine_ranks, colocated, show": (lambda t: [*SHOW, "--set", "rollout.engine_ranks=1"],
                                           "rollout.engine_ranks = 1 is read only"),
    "bf16 engine, fp32 trainer, verify": (lambda t: [*TRAIN, "--set", "rollout.precision=bf16"], "rollout.precision = 'bf16'"),
    "ode rollouts in train": (lambda t: [*TRAIN, "--set", "rollout.sde_type=ode"], "rollout.sde_type = 'ode'"),
    "height not a multiple": (lambda t: [*TRAIN, "--set", "rollout.height=72"], "rollout.height = 72: must be a multiple of 16"),
    "spec malformed": (lambda t: [*SHOW, "--set", 'model.spec="my module:fn"'], "model.spec = 'my module:fn'"),
    "unknown reward": (lambda t: [*TRAIN, "--set", "reward.weights={colour = 1.0}"], "unknown reward 'colour'"),
    "malformed reward path": (lambda t: [*TRAIN, "--set", 'reward.weights={"mymod:" = 1.0}'], "'mymod:'"),
    "reward module not found": (lambda t: [*TRAIN, "--set", 'reward.weights={"no_such_pkg_q.rewards:score" = 1.0}'],
                                "no module 'no_such_pkg_q.rewards' on this Python path"),
    "spec module not found": (lambda t: [*TRAIN, "--set", 'model.spec="megaflow.no_such_spec:make"'],
                              "no module 'megaflow.no_such_spec' on this Python path"),
    "reward kwargs without weight": (lambda t: [*TRAIN, "--set", "reward.weights={jpeg_compressibility = 1.0}"], "reward.kwargs.color_target"),
    "clipscore dir missing": (lambda t: [*TRAIN, "--set", "reward.weights={clipscore = 1.0}", "--set",
                                         f'reward.kwargs={{clipscore = {{path = "{t / "nope"}"}}}}'],
                              "reward.kwargs.clipscore.path: "),
    "aesthetic head missing": (lambda t: [*TRAIN, "--set", "reward.weights={aesthetic = 1.0}", "--set",
                                          f'reward.kwargs={{aesthetic = {{clip_path = "{_clip_dir(t)}", '
                                          f'head_path = "{t / "head.pth"}"}}}}'],
                               "reward.kwargs.aesthetic.head_path: no such file"),
    "imagereward tokenizer missing": (lambda t: [*TRAIN, "--set", "reward.weights={imagereward = 1.0}", "--set",
                                                 f'reward.kwargs={{imagereward = {{path = "{_imagereward_dir(t)}"}}}}'],
                                      "reward.kwargs.imagereward.tokenizer_path: the imagereward reward needs the "
                                      "bert-base-uncased tokenizer's directory (hf download google-bert/bert-base-uncased"),
    "unknown shapes category": (lambda t: [*TRAIN, "--set", 'data.shapes_categories=["squares"]'], "unknown category 'squares'"),
    # run dirs (<run.output_dir>/<run.name>)
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
    # prompt files
    "prompts missing": (lambda t: [*TRAIN, *_prompts(t, None)], "data.prompts: no such file"),
    "prompts: eval.every without test prompts": (lambda t: [*TRAIN, *_prompts(t, b"a red circle\n"), "--set",
                                                            "eval.every=2"], "eval.every = 2 needs test prompts"),
    "prompts: test_prompts missing": (lambda t: [*TRAIN, "--set", "eval.every=1", *_test_prompts(t, None)],
                                      "data.test_prompts: no such file"),
    "prompts: test_prompts jsonl no prompt": (lambda t: [*TRAIN, *_test_prompts(t, b'{"text": "x"}\n', "held.jsonl")],
                                              "data.test_prompts: "),
    "prompts a directory": (lambda t: [*TRAIN, *_prompts(t, None, as_dir=True)], "prompts.txt is not a file"),
    "prompts blank": (lambda t: [*TRAIN, *_prompts(t, b"\n  \n\t\n")], "prompts.txt is empty"),
    "prompts binary": (lambda t: [*SHOW, *_prompts(t, b"a red circle\n\x00\x01\x02")], "prompts.txt is a binary file"),
    "prompts latin-1": (lambda t: [*TRAIN, *_prompts(t, "a caf\xe9 circle\n".encode("latin-1"))], "prompts.txt is not UTF-8"),
    "prompts 10 MB on one line": (lambda t: [*TRAIN, *_prompts(t, b"a red circle " * 769_231)],
                                  "prompts.txt line 1: 10000002 characters, longer than the 2000"),
    "prompts jsonl prompt too long": (lambda t: [*TRAIN, *_prompts(t, b'{"prompt": "%s"}\n' % (b"x" * 2001),
                                                                   name="p.jsonl")], "p.jsonl line 1: a prompt of 2001"),
    "prompts over 64 MiB": (lambda t: [*SHOW, *_prompts(t, None, size=65 << 20)], "prompts.txt is 65 MiB, larger than"),
    "prompts jsonl not JSON": (lambda t: [*TRAIN, *_prompts(t, b'{"prompt": "a"}\n{oops\n', name="p.jsonl")],
                               "p.jsonl line 2: not JSON"),
    "prompts jsonl no prompt": (lambda t: [*TRAIN, *_prompts(t, b'{"text": "OPEN"}\n', name="p.jsonl")],
                                "p.jsonl line 1: needs a non-empty string 'prompt'"),
    "prompts parquet corrupt": (lambda t: [*TRAIN, *_prompts(t, b"PAR1 not a table " * 64, name="p.parquet")],
                                "p.parquet is not a readable parquet file ("),
    "prompts a directory, no dataset": (lambda t: [*TRAIN, *_prompts(t, None, as_dir=True, name="ds")],
                                        "ds is not a file, nor a Hugging Face datasets directory"),
    # pipelines (model.pretrained)
    "pretrained missing": (lambda t: [*TRAIN, "--set", f'model.pretrained="{t / "nope"}"'], "nope is not a directory"),
    "no model_index.json": (lambda t: [*TRAIN, *_pipe(t, lambda p: (p / "model_index.json").unlink())], "has no model_index.json"),
    "component folder gone": (lambda t: [*TRAIN, *_pipe(t, lambda p: shutil.rmtree(p / "vae"))], "pipe/vae"),
    "no transformer config": (lambda t: [*TRAIN, *_pipe(t, lambda p: (p / "transformer/config.json").unlink())], "transformer/config.json not found"),
    "transformer config bad JSON": (lambda t: [*SHOW, *_pipe(t, lambda p: (p / "transformer/config.json").write_text("{"))], "config.json is not valid JSON"),
    "no transformer weights": (lambda t: [*TRAIN, *_pipe(t, lambda p: (p / T).unlink())], "no safetensors weights"),
    "truncated weights": (lambda t: [*TRAIN, *_pipe(t, lambda p: _truncate(p / T, cut=10))], "diffusion_pytorch_model.safetensors is truncated"),
    "garbage weights": (lambda t: [*TRAIN, *_pipe(t, lambda p: (p / T).write_bytes(b"<html>not found</html>"))], "diffusion_pytorch_model.safetensors: corrupt"),
    "truncated VAE weights": (lambda t: [*DEMO, *_pipe(t, lambda p: _truncate(p / "vae/diffusion_pytorch_model.safetensors", keep=5))], "vae/diffusion_pytorch_model.safetensors is truncated"),
    "deleted shard": (lambda t: [*TRAIN, *_pipe(t, lambda p: (p / "transformer/diffusion_pytorch_model-00002-of-00002.safetensors").unlink(), shards=2)], "00002-of-00002.safetensors listed in"),
    "family mismatch": (lambda t: [*TRAIN, *_pipe(t), "--set", "model.family=flux"], "expects a FluxTransformer2DModel"),
    "side beyond position table": (lambda t: [*SHOW, *_pipe(t), "--set", "rollout.height=128"], "rollout.height = 128: larger than 64"),
    "tp does not divide heads": (lambda t: [*SHOW, *_pipe(t), "--set", "parallel.tp=3"], "parallel.tp = 3 does not divide the 4 attention heads"),
    "demo without a pipeline": (lambda t: [*DEMO, "--set", 'model.pretrained=""'], "model.pretrained: the demo needs"),
    # tools/convert_checkpoint.py
    "tool: missing input dir": (lambda t: _tool(t, "to-megatron", t / "nope"), "nope is not a directory"),
    "tool: truncated safetensors": (lambda t: _tool(t, "to-megatron", _transformer(t, lambda d: _truncate(d / "diffusion_pytorch_model.safetensors", cut=1))), "is truncated"),
    "tool: deleted shard": (lambda t: _tool(t, "to-megatron", _transformer(t, lambda d: (d / "diffusion_pytorch_model-00001-of-00003.safetensors").unlink(), shards=3)), "00001-of-00003.safetensors listed in"),
    "tool: truncated shard": (lambda t: _tool(t, "to-megatron", _transformer(t, lambda d: _truncate(d / "diffusion_pytorch_model-00002-of-00003.safetensors", cut=100), shards=3)), "00002-of-00003.safetensors is truncated"),
    "tool: checkpoint without .metadata": (lambda t: _tool(t, "to-diffusers", (lambda c: (c / ".metadata").unlink() or c)(fake_megatron_checkpoint(t / "ckpt"))), ".metadata not found"),
    "tool: not a megaflow checkpoint": (lambda t: _tool(t, "to-diffusers", _transformer(t)), "megaflow_model.json not found"),
    "eval --pipeline truncated": (lambda t: ["eval", "shapes", "--pipeline", str(_pipe_dir(t, lambda p: _truncate(
        p / T, cut=4)))], "--pipeline: "),
    # image folders (megaflow eval shapes --images)
    "images: missing dir": (lambda t: ["eval", "shapes", "--images", str(t / "nope")], "images dir does not exist"),
    "images: empty dir": (lambda t: _images(t, {}), "no images"),
    "images: not an image": (lambda t: _images(t, {"a_red_circle.png": b"this is text"}), "cannot read image"),
    "images: 20000 x 20000 png": (lambda t: _images(t, {"a_red_circle.png": png_header(20000, 20000)}),
                                  "more than 67108864 pixels (8192 x 8192), refused before decoding"),
    "images: 9000 x 9000 png": (lambda t: _images(t, {"a_red_circle.png": png_header(9000, 9000)}),
                                "refused before decoding (9000 x 9000)"),
    "images: manifest not UTF-8": (lambda t: _images(t, {"manifest.jsonl": b"\xff\xfe{}"}), "manifest.jsonl is not UTF-8"),
    # image folders (megaflow eval reward --images)
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
    # round 3 (issue 35): nesting and sizes, duplicate steps, long paths, loops, text chunks, old cases
    "config nested 5000 deep": (lambda t: ["config", "show", "-c", str(_cfg(
        t, "[reward]\nkwargs = { a = " + "[" * 5000 + "]" * 5000 + " }\n"))], "nested too deeply to read"),
    "config nested 20 deep": (lambda t: ["config", "show", "-c", str(_cfg(
        t, "[reward]\nkwargs = { a = " + "[" * 20 + "]" * 20 + " }\n"))],
                              "reward.kwargs: nested more than 16 lists or tables deep"),
    "config: sde_window of 1e6 steps": (lambda t: ["config", "show", "-c", str(_cfg(
        t, "[rollout]\nsde_window = [" + "1, " * 1_000_000 + "]\n"))], "larger than the 1 MiB a run file may be"),
    "sde_window of 5000 steps": (lambda t: [*SHOW, "--set", "rollout.sde_window=[" + "1," * 5000 + "]"],
                                 "rollout.sde_window: 5000 entries in one list, more than the 4096"),
    "sde_window duplicates": (lambda t: [*TRAIN, "--set", "rollout.sde_window=[1, 1, 1]"],
                              "rollout.sde_window: step [1] listed more than once"),
    "prompts: a 130 KB path": (lambda t: ["train", "-c", str(_cfg(t, f'[data]\nprompts = "/{"p" * 130_000}.txt"\n'))],
                               "characters): File name too long"),
    "unknown colour in reward kwargs": (lambda t: [*TRAIN, "--set",
                                                   'reward.kwargs={color_target = {target = "purpleish"}}'],
                                        "reward.kwargs.color_target.target: unknown colour 'purpleish'"),
    "height beyond the tiny pipeline's position table": (lambda t: [*TRAIN, "--set", "rollout.height=512"],
                                                         "rollout.height = 512: larger than 256"),
    "tool: --tp 3 on 4 heads": (lambda t: [*_tool(t, "to-megatron", _transformer(t)), "--tp", "3"],
                                "--tp = 3 does not divide the 4 attention heads"),
    "run dir: resume, state.json iteration '4'": (lambda t: _runs(t, _resume_state(iteration="4"), "--resume"),
                                                  "iteration = '4': want an integer >= 1"),
    "run dir: resume, negative prompts_consumed": (lambda t: _runs(t, _resume_state(prompts_consumed=-3), "--resume"),
                                                   "prompts_consumed = -3: want an integer >= 0"),
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
}
if not cuda_available():  # valid settings on a GPU machine
    CASES["cuda without a GPU"] = (lambda t: [*TRAIN, "--set", "run.device=cuda"], "run.device = 'cuda'")
    CASES["spec te without a GPU"] = (lambda t: [*TRAIN, "--set", "model.spec=te"], "model.spec = 'te'")
    CASES["clipscore on cuda without a GPU"] = (lambda t: [
        *TRAIN, "--set", "reward.weights={clipscore = 1.0}", "--set",
        f'reward.kwargs={{clipscore = {{path = "{_clip_dir(t)}", device = "cuda"}}}}'], "reward.kwargs.clipscore.device")


def _snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (symlinks not followed): a file's SHA-256, a link's target, "dir"."""
    out = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(top) / name
            if p.is_symlink():
                out[str(p.relative_to(root))] = "-> " + os.readlink(p)
            elif p.is_dir():
                out[str(p.relative_to(root))] = "dir"
            else:
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_input_one_line_exit_2(name, tmp_path):
    build, needle = CASES[name]
    argv = build(tmp_path)
    target = str(REPO / "tools" / "convert_checkpoint.py") if argv[0] == "tool" else "cli"
    argv = argv[1:] if argv[0] == "tool" else argv
    if argv[0] in ("train", "demo", "config"):
        argv += ["--set", f'run.output_dir="{tmp_path / "runs"}"']
    before, made_runs = _snapshot(tmp_path), os.path.lexists(tmp_path / "runs")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    r = subprocess.run([sys.executable, "-c", WRAPPER, target, *argv], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and lines[0].strip(), r.stderr[-2000:]
    assert needle in lines[0], lines[0]
    assert "Traceback" not in r.stderr
    assert r.stdout.splitlines() == ["HEAVY="], f"heavy imports or output: {r.stdout[-500:]}"
    assert os.path.lexists(tmp_path / "runs") == made_runs
    assert _snapshot(tmp_path) == before, "the command wrote files"


def test_table_covers_every_kind_of_input():
    assert len(CASES) >= 25
    assert sum(k.startswith("tool:") for k in CASES) >= 4 and sum(k.startswith("images:") for k in CASES) >= 3
    assert sum(k.startswith("prompts") for k in CASES) >= 4 and sum(k.startswith("reward:") for k in CASES) >= 6
    assert sum(k.startswith("run dir:") for k in CASES) >= 6
