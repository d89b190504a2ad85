"""Malformed configs, ``--set`` values, prompt files, pipelines and checkpoints stop every command at once with ONE
line: the real CLI (and tools/convert_checkpoint.py) run as a subprocess in a temp dir for each row. Each must exit
with code 2, print exactly one non-empty stderr line holding the expected text (naming the key or file), no
traceback, nothing on stdout, write nothing (every file in the temp dir byte-identical; ``run.output_dir`` is never
created unless the row made it), and never import torch, megatron, sglang, diffusers or transformers
(malformed_builders.check_one_line_exit_2). Run dirs, image folders and reward inputs: test_malformed_files.py.
Needs: CPU, 1 process at a time, no torch (~10 s)."""
from __future__ import annotations

import os
import shutil

import pytest

from malformed_builders import (  # tests/config/malformed_builders.py
    DEMO, MARKER, PRETRAIN, SHOW, T, TRAIN, _based, _cfg, _chain, _clip_dir, _imagereward_dir, _parquet_prompts,
    _pipe, _pipe_dir, _prompts, _remote, _test_prompts, _tool, _transformer, _truncate, add_remote_code,
    fake_megatron_checkpoint, check_one_line_exit_2,
)
from megaflow.config.preflight import cuda_available

AWM = ["--set", "algo.name=awm", "--set", "rollout.sde_type=ode"]
DGPO = ["--set", "algo.name=dgpo", "--set", "rollout.sde_type=ode"]
WAN = ["--set", "model.family=wan", "--set", "rollout.num_frames=5"]


CASES = {
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
    "prompts parquet holding a 64 MB string": (lambda t: [*TRAIN, *_parquet_prompts(t, ["a red circle", "x" * (64 << 20)])],
                                              "p.parquet row group 0: its 'prompt' column holds 671"),
    "prompts parquet prompt too long": (lambda t: [*TRAIN, *_parquet_prompts(t, ["a red circle", "x" * 2001])],
                                        "p.parquet row 1 (counting from 0): a prompt of 2001 characters"),
    "prompts parquet corrupt": (lambda t: [*TRAIN, *_prompts(t, b"PAR1 not a table " * 64, name="p.parquet")],
                                "p.parquet is not a readable parquet file ("),
    "prompts a directory, no dataset": (lambda t: [*TRAIN, *_prompts(t, None, as_dir=True, name="ds")],
                                        "ds is not a file, nor a Hugging Face datasets directory"),
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
    "tool: missing input dir": (lambda t: _tool(t, "to-megatron", t / "nope"), "nope is not a directory"),
    "tool: truncated safetensors": (lambda t: _tool(t, "to-megatron", _transformer(t, lambda d: _truncate(d / "diffusion_pytorch_model.safetensors", cut=1))), "is truncated"),
    "tool: deleted shard": (lambda t: _tool(t, "to-megatron", _transformer(t, lambda d: (d / "diffusion_pytorch_model-00001-of-00003.safetensors").unlink(), shards=3)), "00001-of-00003.safetensors listed in"),
    "tool: truncated shard": (lambda t: _tool(t, "to-megatron", _transformer(t, lambda d: _truncate(d / "diffusion_pytorch_model-00002-of-00003.safetensors", cut=100), shards=3)), "00002-of-00003.safetensors is truncated"),
    "tool: checkpoint without .metadata": (lambda t: _tool(t, "to-diffusers", (lambda c: (c / ".metadata").unlink() or c)(fake_megatron_checkpoint(t / "ckpt"))), ".metadata not found"),
    "tool: not a megaflow checkpoint": (lambda t: _tool(t, "to-diffusers", _transformer(t)), "megaflow_model.json not found"),
    "eval --pipeline truncated": (lambda t: ["eval", "shapes", "--pipeline", str(_pipe_dir(t, lambda p: _truncate(
        p / T, cut=4)))], "--pipeline: "),
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
    "video config, image family": (lambda t: [*TRAIN, "--set", "rollout.num_frames=5"],
                                   "rollout.num_frames = 5: model.family = 'sd3' samples images"),
    "image config, video family": (lambda t: [*TRAIN, *WAN[:2]], "model.family = 'wan' samples videos: set rollout.num_frames"),
    "frames the VAE cannot compress": (lambda t: [*TRAIN, *WAN[:2], "--set", "rollout.num_frames=6"],
                                       "rollout.num_frames = 6: Wan's VAE compresses 4 frames into one after the first, "
                                       "so it takes k * 4 + 1 frames (5 or 9)"),
    "frames beyond the rotary table": (lambda t: [*TRAIN, *WAN[:2], "--set", "rollout.num_frames=201"],
                                       "rollout.num_frames = 201: 51 latent frames, more than the 32 positions per axis"),
    "clip side beyond the rotary table": (lambda t: [*TRAIN, *WAN, "--set", "rollout.height=576"],
                                          "rollout.height = 576: 36 tokens, more than the 32 positions per axis"),
    "image reward on whole clips": (lambda t: [*TRAIN, *WAN, "--set", 'reward.frames="video"'],
                                    "reward.frames = 'video' hands whole clips to every reward, but 'color_target' "
                                    "scores images"),
    "reward frame beyond the clip": (lambda t: [*TRAIN, *WAN, "--set", 'reward.frames="5"'],
                                     "reward.frames = '5': the clips have 5 frames"),
    "video run evaluated by ShapeEval": (lambda t: [*TRAIN, *WAN, "--set", "eval.every=1"],
                                         "eval.every = 1 without data.test_prompts evaluates with ShapeEval"),
    "reward frames not a mode": (lambda t: [*SHOW, "--set", 'reward.frames="last"'], "reward.frames = 'last': must be one of"),
    "height beyond the tiny pipeline's position table": (lambda t: [*TRAIN, "--set", "rollout.height=512"],
                                                         "rollout.height = 512: larger than 256"),
    "tool: --tp 3 on 4 heads": (lambda t: [*_tool(t, "to-megatron", _transformer(t)), "--tp", "3"],
                                "--tp = 3 does not divide the 4 attention heads"),
    # A model directory naming code (a payload that would write <tmp>/payload-ran: the harness finds no file written)
    "remote code: train, a text encoder's auto_map": (lambda t: [*TRAIN, "--set", f'model.pretrained="{_remote(
        t, "auto_map")}"'], "model.pretrained: " + "{t}/pipe/text_encoder/config.json: auto_map "),
    "remote code: train, a custom component": (lambda t: [*TRAIN, "--set", f'model.pretrained="{_remote(
        t, "component")}"'], "pipe/text_encoder/payload.py: custom component class ['payload', 'PayloadModel'] for "
                             "'text_encoder' (not from diffusers or transformers); code in a model directory runs "
                             "only with --trust-remote-code"),
    "remote code: demo, a custom pipeline class": (lambda t: [*DEMO, "--set", f'model.pretrained="{_remote(
        t, "pipeline")}"'], "pipe/model_index.json: custom pipeline class ['payload', 'PayloadModel']"),
    "remote code: pretrain.init_from, a tokenizer's auto_map": (lambda t: [
        *PRETRAIN, "--set", f'run.output_dir="{t / "runs"}"', "--set", f'pretrain.init_from="{_remote(
            t, "auto_map", folder="tokenizer")}"'], "pretrain.init_from: "),
    "remote code: eval shapes --sampler diffusers, a custom component": (lambda t: [
        "eval", "shapes", "--pipeline", str(_remote(t, "component")), "--sampler", "diffusers"],
        "--pipeline: " + "{t}/pipe/text_encoder/payload.py: custom component class"),
    "remote code: eval shapes (sglang), auto_map": (lambda t: [
        "eval", "shapes", "--pipeline", str(_remote(t, "auto_map", folder="text_encoder_2"))],
        "pipe/text_encoder_2/config.json: auto_map"),
    "remote code: train --trust-remote-code, a custom component the engine cannot load": (lambda t: [
        *TRAIN, "--trust-remote-code", "--set", f'model.pretrained="{_remote(t, "component")}"'],
        "pipe/text_encoder/payload.py: custom component class ['payload', 'PayloadModel'] for 'text_encoder' (not "
        "from diffusers or transformers): the SGLang engine cannot load it"),
    "remote code: eval shapes --trust-remote-code, a custom component the engine cannot load": (lambda t: [
        "eval", "shapes", "--pipeline", str(_remote(t, "component")), "--trust-remote-code"],
        "--pipeline: " + "{t}/pipe/text_encoder/payload.py: custom component class"),
    "tool: remote code, auto_map": (lambda t: _tool(t, "to-megatron", add_remote_code(
        _transformer(t), "auto_map", marker=t / MARKER, folder="")), "--src: " + "{t}/pipe/transformer/config.json: "
                                                                                  "auto_map"),
    "config: a 1 MB unknown key": (lambda t: ["config", "show", "-c", str(_cfg(
        t, "[run]\n" + "k" * 1_000_000 + " = 1\n"))], "unknown key run.kkkk"),
    "config: base a symlink loop": (lambda t: _based(t, lambda b: b.symlink_to(b.name)),
                                    "base.toml (the base of"),
    "config: base a FIFO": (lambda t: _based(t, os.mkfifo), "base.toml (the base of"),
    "config: base /dev/zero": (lambda t: _based(t, lambda b: b.symlink_to("/dev/zero")),
                               "not a regular file (a TOML run file is one)"),
    "config: base a directory": (lambda t: _based(t, lambda b: b.mkdir()), "not a regular file"),
    "config: base a table": (lambda t: ["config", "show", "-c", str(_cfg(t, "[base]\nfile = 'a.toml'\n"))],
                             "base must be the path of another run file (a string), got {'file': 'a.toml'}"),
    "config: base's section not a table": (lambda t: _based(t, lambda b: b.write_text("run = 3\n")),
                                           "base.toml: section 'run' must be a table, got 3"),
    "config: base nested 5000 deep": (lambda t: _based(t, lambda b: b.write_text(
        "[reward]\nkwargs = { a = " + "[" * 5000 + "]" * 5000 + " }\n")), "base.toml: nested too deeply to read"),
    "config: a chain of 17 bases": (lambda t: _chain(t, 17), "more than 16 files in one chain of base"),
}
if not cuda_available():  # valid settings on a GPU machine
    CASES["cuda without a GPU"] = (lambda t: [*TRAIN, "--set", "run.device=cuda"], "run.device = 'cuda'")
    CASES["spec te without a GPU"] = (lambda t: [*TRAIN, "--set", "model.spec=te"], "model.spec = 'te'")
    CASES["clipscore on cuda without a GPU"] = (lambda t: [
        *TRAIN, "--set", "reward.weights={clipscore = 1.0}", "--set",
        f'reward.kwargs={{clipscore = {{path = "{_clip_dir(t)}", device = "cuda"}}}}'], "reward.kwargs.clipscore.device")


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_input_one_line_exit_2(name, tmp_path):
    build, needle = CASES[name]
    check_one_line_exit_2(build(tmp_path), tmp_path, needle.replace("{t}", str(tmp_path)))


def test_a_long_unknown_key_gets_no_did_you_mean_search(monkeypatch):
    """difflib is quadratic in the word: a key over suggest.MAX_WORD characters is never handed to it, and the
    message shows its start and length."""
    import difflib

    from megaflow.config import ConfigError, load_config
    from megaflow.config import suggest
    monkeypatch.setattr(difflib, "get_close_matches", lambda *a, **k: pytest.fail("difflib searched"))
    assert suggest.did_you_mean("x" * (suggest.MAX_WORD + 1), ["x"]) == ""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["run." + "k" * 100_000 + "=1"])
    assert f"run.{'k' * 76}... (100004 characters) = 1" in str(e.value) and len(str(e.value)) < 200


def test_table_covers_every_kind_of_input():
    assert len(CASES) >= 25
    assert sum(k.startswith("tool:") for k in CASES) >= 4 and sum(k.startswith("prompts") for k in CASES) >= 4
