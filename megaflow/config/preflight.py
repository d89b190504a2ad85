"""Everything about a run that can be checked before the work starts, with the standard library only
(pyarrow / datasets to read a prompt table). Design notes: docs/design/config.md.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from megaflow.config.algo_checks import CLEAN_SAMPLE_ALGORITHMS
from megaflow.config.dotted import is_dotted_path, unfindable
from megaflow.config.files import (check_backend_paths, check_pipeline, check_safetensors, check_text_file,
                                   os_error)
from megaflow.config.load import ConfigError, run_dir_of
from megaflow.config.logging_check import check_logging
from megaflow.config.machine import cuda_available
from megaflow.config.remote_code import refuse_custom_components, refuse_remote_code
from megaflow.config.reward_check import REWARD_ARGS, SERVER_REWARDS, check_rewards  # noqa: F401 (re-exported)
from megaflow.config.schema import MegaflowConfig
from megaflow.config.video_check import check_frames, check_positions
from megaflow.data.prompts import MAX_PROMPT_CHARS, is_table_source, prompt_pool, read_jsonl_prompts
from megaflow.data.shapes import CATEGORIES
from megaflow.families import card, family_names
from megaflow.flow.window import check_sde_window
from megaflow.parallel.dims import ParallelDims
from megaflow.parallel.placement import launch_layout

# Names of megaflow.rewards.registry.REWARDS (megaflow.config.reward_check) and megaflow.models.provider.BUILTIN_SPECS:
# those modules import torch, so the names are kept here and tests/config/test_preflight.py checks that they are
# equal. What a model family needs checked is its card (megaflow.families).
REWARD_NAMES = tuple(REWARD_ARGS)
BUILTIN_SPECS = ("auto", "local", "te")
COMMANDS = ("train", "demo", "show", "pretrain")
DEFAULT_PIXEL_MULTIPLE = 16  # VAE factor 8 x patch 2: the tiny pipelines megaflow builds (SD3, FLUX, Wan)
_ENGINE_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def preflight(cfg: MegaflowConfig, command: str = "train", *, files: bool = True) -> MegaflowConfig:
    """Check ``cfg`` for ``command``; returns it unchanged or raises ConfigError. ``files=False`` (with "show", or
    "train" for its --dry-run) skips checks of the files the config names and of model rewards' CUDA device."""
    if not files and command not in ("show", "train"):
        raise ValueError(f"preflight(files=False) is for 'show' and 'train' only, got {command!r}")
    if command not in COMMANDS:
        raise ValueError(f"preflight command must be one of {COMMANDS}, got {command!r}")
    try:
        return _preflight(cfg, command, files)
    except OSError as e:  # a path no check named: the file system's reason, the path shortened
        raise os_error("a path of the config", e.filename, e) from None


def _preflight(cfg: MegaflowConfig, command: str, files: bool) -> MegaflowConfig:
    _check_run(cfg, files=files)
    _check_parallel(cfg, launch=command in ("train", "demo", "pretrain"))
    _check_recompute(cfg)
    if command == "pretrain":
        _check_pretrain(cfg)
        _check_model_code(cfg, command)
        return cfg
    if command == "demo" and not cfg.model.pretrained:
        raise ConfigError("model.pretrained: the demo needs a pretrained pipeline (e.g. assets/shapeeval-sd3)")
    _check_data(cfg, files=files)
    check_rewards(cfg, probe=command in ("train", "demo"), files=files)
    _check_rollout(cfg)
    check_frames(cfg, files=files)
    _check_bridge(cfg)
    _check_lora(cfg, files=files)
    if command == "train" and files:  # the demo writes to a fresh run dir
        check_backend_paths(run_dir_of(cfg), wandb=cfg.logging.wandb, tensorboard=cfg.logging.tensorboard)
    check_logging(cfg)
    if files or not cfg.model.pretrained:
        _check_model(cfg)
    _check_model_code(cfg, command)
    return cfg


def _check_model_code(cfg: MegaflowConfig, command: str) -> None:
    """The model directory the command loads (model.pretrained; pretrain.init_from) names no code to run, unless
    model.trust_remote_code (--trust-remote-code), and (train, demo: the SGLang engines load it) no custom class;
    ``show`` loads nothing."""
    if command == "show":
        return
    key = "pretrain.init_from" if command == "pretrain" else "model.pretrained"
    path = cfg.pretrain.init_from if command == "pretrain" else cfg.model.pretrained
    if path:
        refuse_remote_code(path, key, trust=cfg.model.trust_remote_code)
    if path and command != "pretrain":
        refuse_custom_components(path, key)


def _check_run(cfg: MegaflowConfig, *, files: bool = True) -> None:
    try:
        run_dir_of(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.run.device == "cuda" and not cuda_available():
        raise ConfigError("run.device = 'cuda' but this machine has no visible CUDA device (use 'auto' or 'cpu')")
    spec = cfg.model.spec
    if spec not in BUILTIN_SPECS and not is_dotted_path(spec):
        raise ConfigError(f"model.spec = {spec!r}: expected one of {', '.join(BUILTIN_SPECS)} or 'pkg.mod:fn'")
    if files and spec not in BUILTIN_SPECS and (missing := unfindable(spec)):  # the run's Python path
        raise ConfigError(f"model.spec = {spec!r}: no module {missing!r} on this Python path")
    if spec == "te":
        if not cuda_available():
            raise ConfigError("model.spec = 'te': Transformer Engine layers need a CUDA device; this machine has "
                              "none (use 'auto' or 'local')")
        if importlib.util.find_spec("transformer_engine") is None:
            raise ConfigError("model.spec = 'te': transformer_engine is not installed (pip install -e .[gpu])")


def _check_parallel(cfg: MegaflowConfig, *, launch: bool) -> None:
    p = cfg.parallel
    if p.cp > 1:
        raise ConfigError(f"parallel.cp = {p.cp}: the DiT models have no context parallelism yet "
                          "(megaflow.models.common.model); use parallel.cp = 1")
    if p.gpus:  # the layout's own launch size: whole nodes aside, its trainer ranks must split into replicas
        _check_launch(cfg, str(p.gpus), str(p.gpus), f"parallel.gpus = {p.gpus}")
    world = os.environ.get("WORLD_SIZE", "1")
    local = os.environ.get("LOCAL_WORLD_SIZE", world)
    if not launch or not world.isdigit() or not local.isdigit():
        return
    if p.gpus and int(world) != p.gpus:
        raise ConfigError(f"parallel.gpus = {p.gpus} but {world} process(es) were launched (WORLD_SIZE): launch "
                          f"{p.gpus}, or --set parallel.gpus={world} (0 = any launch size)")
    _check_launch(cfg, world, local, f"the {world} launched process(es) (WORLD_SIZE)")


def _check_launch(cfg: MegaflowConfig, world: str, local: str, launched: str) -> None:
    """The engine placement and the trainer layout of a launch of ``world`` ranks (``launched`` says what they
    are in a message)."""
    p, r = cfg.parallel, cfg.rollout
    try:
        _, trainers = launch_layout(r.placement, r.engine_hosts, r.engine_ranks, int(world), int(local))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    what = (launched if trainers == int(world) else
            f"the {trainers} trainer rank(s) ({launched} minus rollout.engine_ranks = {r.engine_ranks})")
    try:
        ParallelDims.of(p).dp_for(trainers, ranks=what)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_recompute(cfg: MegaflowConfig) -> None:
    t = cfg.train
    if t.recompute == "none" and t.recompute_num_layers:
        raise ConfigError(f"train.recompute_num_layers = {t.recompute_num_layers} is only read with "
                          "train.recompute = 'full' (train.recompute = 'none')")


def _positive_int(conf: dict, key: str) -> int | None:
    value = conf.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _check_layout(cfg: MegaflowConfig, heads: int | None, layers: int | None, where: str) -> None:
    """Megatron splits attention heads over TP ranks and blocks evenly over PP (x VPP) stages."""
    try:
        ParallelDims.of(cfg.parallel).check_model(heads, layers, where)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_pretrain(cfg: MegaflowConfig) -> None:
    p, fam = cfg.pretrain, card(cfg.model.family)
    if not fam.shapes_pipeline:
        able = ", ".join(n for n in family_names() if card(n).shapes_pipeline)
        raise ConfigError(f"model.family = {fam.name!r}: megaflow pretrain builds the ShapeEval pipeline of {able} only")
    if p.init_from:
        tconf = check_pipeline(p.init_from, "pretrain.init_from")["transformer"]
        if tconf.get("_class_name") != fam.diffusers_class:
            raise ConfigError(f"pretrain.init_from: {p.init_from} holds a {tconf.get('_class_name')}, not "
                              f"model.family = {fam.name!r}'s {fam.diffusers_class}")
        _check_layout(cfg, _positive_int(tconf, "num_attention_heads"), _positive_int(tconf, "num_layers"), p.init_from)
    else:
        _check_layout(cfg, p.num_heads, p.num_layers, "the pretrained DiT (pretrain.num_heads / num_layers)")


def _check_data(cfg: MegaflowConfig, *, files: bool = True) -> None:
    d = cfg.data
    unknown = [c for c in d.shapes_categories if c not in CATEGORIES]
    if unknown:
        raise ConfigError(f"data.shapes_categories: unknown categor{'y' if len(unknown) == 1 else 'ies'} "
                          f"{', '.join(map(repr, unknown))} (known: {', '.join(CATEGORIES)})")
    if d.prompts != "shapes":
        if d.shapes_categories:
            raise ConfigError(f"data.shapes_categories = {d.shapes_categories} is only read with "
                              f"data.prompts = 'shapes' (data.prompts = {d.prompts!r})")
        if files:
            _check_prompt_file(d.prompts, "data.prompts")
    if cfg.eval.every and not d.test_prompts and d.prompts != "shapes":
        raise ConfigError(f"eval.every = {cfg.eval.every} needs test prompts: set data.test_prompts (a prompt "
                          "file), or use data.prompts = 'shapes' (ShapeEval's held-out prompts)")
    if d.test_prompts and files:
        _check_prompt_file(d.test_prompts, "data.test_prompts")
    e = cfg.eval
    if not d.test_prompts and (e.samples_per_prompt > 1 or e.group_by):
        key = "eval.samples_per_prompt" if e.samples_per_prompt > 1 else "eval.group_by"
        raise ConfigError(f"{key} is read by the evaluation on data.test_prompts; set data.test_prompts")


def _check_prompt_file(path: str, key: str) -> None:
    """A text, .jsonl or .parquet prompt file or a ``datasets`` directory (config ``key``) that the prompt pool
    can read; ConfigError otherwise. A table (parquet, dataset) is read whole, as the run will read it."""
    try:
        if is_table_source(path):  # binary: not for the text-file check
            prompt_pool(path, seed=0, key=key)
            return
        jsonl = Path(path).suffix == ".jsonl"  # a line holds the prompt and its metadata
        check_text_file(path, key, max_line=None if jsonl else MAX_PROMPT_CHARS)
        if jsonl:
            read_jsonl_prompts(path, key)
    except ValueError as e:  # ConfigError is one too
        raise ConfigError(str(e)) from None
    except OSError as e:
        raise os_error(key, path, e) from None


def _sde_steps(cfg: MegaflowConfig) -> list[int] | None:
    """The fixed SDE window (None = all steps, or a window drawn each iteration); the window's rules are
    megaflow.flow.window's."""
    r = cfg.rollout
    try:
        drawn = check_sde_window(num_steps=r.num_steps, window=r.sde_window, window_size=r.sde_window_size,
                                 window_range=r.sde_window_range, sde_type=r.sde_type)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return (list(r.sde_window) or None) if drawn is None else None


def _check_rollout(cfg: MegaflowConfig) -> None:
    r, n = cfg.rollout, cfg.rollout.num_steps
    if cfg.algo.name in CLEAN_SAMPLE_ALGORITHMS:
        CLEAN_SAMPLE_ALGORITHMS[cfg.algo.name](cfg)
        return
    if r.sde_type == "ode":
        raise ConfigError("rollout.sde_type = 'ode' samples no log-probs: nothing for FlowGRPO to train (use 'sde' "
                          "or 'cps', or algo.name = 'nft', 'awm' or 'dgpo')")
    if r.noise_level == 0 and not r.log_prob_no_const:
        raise ConfigError(f"rollout.noise_level: noise_level=0 has std 0: a log-prob with constants needs "
                          f"noise_level > 0 (or rollout.log_prob_no_const = true) with sde_type = {r.sde_type!r}")
    window = _sde_steps(cfg)
    if r.sde_window_size == 0:
        steps = sorted(set(window)) if window is not None else list(range(int(n * cfg.algo.timestep_fraction)))
        if r.sde_type == "cps":
            steps = [t for t in steps if t != n - 1]
        if not steps:
            raise ConfigError(f"no trainable step among sde_step_indices={window!r} for {r.sde_type} (num_steps={n}, "
                              f"timestep_fraction={cfg.algo.timestep_fraction}): check rollout.sde_window, "
                              "rollout.num_steps and algo.timestep_fraction")


def _check_bridge(cfg: MegaflowConfig) -> None:
    b, r = cfg.bridge, cfg.rollout
    if r.placement == "colocated" and r.engine_ranks:
        raise ConfigError(f"rollout.engine_ranks = {r.engine_ranks} is read only with rollout.placement = "
                          "'disaggregated' (colocated: every rank trains; rollout.engine_hosts picks engine hosts)")
    if r.placement == "disaggregated":
        if r.engine_ranks < 1:
            raise ConfigError("rollout.placement = 'disaggregated' needs rollout.engine_ranks >= 1 (how many of the "
                              "launched ranks only sample)")
        if r.engine_hosts != "rank0":
            raise ConfigError(f"rollout.engine_hosts = {r.engine_hosts!r} is read only with rollout.placement = "
                              "'colocated' (disaggregated: every engine-only rank hosts engines)")
        if b.mode != "distributed":
            raise ConfigError(f"rollout.placement = 'disaggregated' with bridge.mode = {b.mode!r}: engine-only ranks "
                              "hold no trainer weights; use bridge.mode = 'distributed'")
    if b.mode == "disk" and r.engine_hosts != "rank0":
        raise ConfigError(f"bridge.mode = 'disk' writes the weights on rank 0 only; with rollout.engine_hosts = "
                          f"{r.engine_hosts!r} use bridge.mode = 'shared_memory' or 'distributed'")
    t = cfg.train
    if t.offload != "none" and not cfg.phased:
        raise ConfigError(f"train.offload = {t.offload!r} with rollout.placement = {r.placement!r}, "
                          f"train.max_staleness = {t.max_staleness}: the trainer offloads only while engines on its "
                          "ranks sample alone (rollout.placement = 'colocated', train.max_staleness = 0)")
    engine_dtype = _ENGINE_DTYPE[r.precision]
    if b.verify and engine_dtype != cfg.model.dtype:
        raise ConfigError(f"rollout.precision = {r.precision!r} with model.dtype = {cfg.model.dtype!r} and "
                          f"bridge.verify = true: the engine re-hashes its {engine_dtype} copy, which never matches "
                          f"the trainer's {cfg.model.dtype} digests; use matching dtypes or bridge.verify = false")


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # megaflow.models.common.lora.TARGETS


def _check_lora(cfg: MegaflowConfig, *, files: bool = True) -> None:
    lo = cfg.lora
    bad = [t for t in lo.targets if t not in LORA_TARGETS]
    if bad or not lo.targets:
        raise ConfigError(f"lora.targets = {lo.targets}: each must be one of {list(LORA_TARGETS)}")
    if lo.rank == 0:
        if lo.init:
            raise ConfigError(f"lora.init = {lo.init!r} needs lora.rank > 0")
        return
    if cfg.bridge.mode != "shared_memory":
        raise ConfigError(f"lora.rank = {lo.rank} with bridge.mode = {cfg.bridge.mode!r}: the LoRA sync "
                          "(SGLang's lora_merge tensor update) runs only with bridge.mode = 'shared_memory'")
    if lo.init and files:
        path = Path(lo.init) / ("pytorch_lora_weights.safetensors" if Path(lo.init).is_dir() else "")
        if not path.is_file():
            raise ConfigError(f"lora.init = {lo.init!r}: no such file (or directory with "
                              "pytorch_lora_weights.safetensors)")
        check_safetensors(path, "lora.init")  # the header, before any weights are read


def _pixel_multiple(cfg: MegaflowConfig, configs: dict[str, dict]) -> tuple[int, int | None]:
    """(the multiple image sides must have, the largest side or None) for the pipeline: the VAE downsamples
    by 2^(len(block_out_channels)-1) (diffusers' vae_scale_factor), then the DiT patches latents by
    patch_size (FLUX packs 2x2); SD3's position table covers pos_embed_max_size patches per side."""
    vae, tconf = configs.get("vae", {}), configs["transformer"]
    blocks = vae.get("block_out_channels")
    factor = 2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else 8
    family = card(cfg.model.family)
    patch = family.latent_pack or _positive_int(tconf, "patch_size") or 2
    max_patches = _positive_int(tconf, "pos_embed_max_size") if family.position_table else None
    return factor * patch, (max_patches * factor * patch if max_patches else None)


def _check_model(cfg: MegaflowConfig) -> None:
    r, key = cfg.rollout, "model.pretrained"
    family = card(cfg.model.family)
    multiple, where, tconf = DEFAULT_PIXEL_MULTIPLE, "the tiny pipeline built for the run", None
    largest = family.tiny_positions * DEFAULT_PIXEL_MULTIPLE if family.tiny_positions else None
    if cfg.model.pretrained:
        configs = check_pipeline(cfg.model.pretrained, key)
        tconf, where = configs["transformer"], cfg.model.pretrained
        want = family.diffusers_class
        if tconf.get("_class_name") != want:
            raise ConfigError(f"model.family = {cfg.model.family!r} expects a {want} but {where}/transformer is "
                              f"{tconf.get('_class_name')!r}")
        layers = _positive_int(tconf, family.blocks_key) if family.blocks_key else None
        _check_layout(cfg, _positive_int(tconf, "num_attention_heads"), layers, where)
        multiple, largest = _pixel_multiple(cfg, configs)
    check_positions(cfg, tconf, where, multiple)
    for side in ("height", "width"):
        value = getattr(r, side)
        if value % multiple:
            raise ConfigError(f"rollout.{side} = {value}: must be a multiple of {multiple} for {where} "
                              "(VAE downsampling x DiT patch size)")
        if largest is not None and value > largest:
            raise ConfigError(f"rollout.{side} = {value}: larger than {largest}, the most the position table of "
                              f"{where} covers (pos_embed_max_size)")
