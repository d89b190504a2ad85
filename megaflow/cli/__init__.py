"""The ``megaflow`` command line; argparse lives in this package only (no Namespace escapes it). Heavy imports
happen inside the handlers so ``megaflow --help`` is instant.
"""
from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path

from megaflow.cli.bench import add_bench_parsers
from megaflow.cli.evaluate import add_eval_parsers
from megaflow.cli.common import (Handler, add_config_args, add_trust_remote_code_arg, add_verbose_arg, apply_device,
                                 load_checked, print_json, run_config)
from megaflow.config import ConfigError, dump_config, load_config, run_dir_of
from megaflow.config.preflight import preflight
from megaflow.rundir.interrupt import Interrupted, adopt_orphans, child_pids, kill_children

TRUST_HELP = ("Load a checkpoint lacking MANIFEST.json, and skip the trust checks of its metadata and pickles "
              "(torch unpickles them and reads what they name): only from a trusted source.")


def _cmd_config_show(args: argparse.Namespace) -> int:
    from megaflow.config.algo_defaults import describe
    cfg = preflight(load_config(args.config, args.overrides), "show", files=not args.no_files)
    print("\n".join(describe(cfg.algo.name)))
    print(dump_config(cfg), end="")
    return 0


def _cmd_config_keys(args: argparse.Namespace) -> int:
    from megaflow.config.keys import config_keys, format_keys, matching
    keys = matching(config_keys(), args.words)
    if not keys:
        raise ValueError(f"no config key matches {' '.join(args.words)!r} (megaflow config keys lists them all)")
    print(format_keys(keys))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from megaflow.plan.memory import check_plan_args, format_plan, plan
    given = check_plan_args(args.gpus, args.gpu_mem_gb)
    cfg = preflight(load_config(args.config, args.overrides), "show", files=False)
    from megaflow.parallel.placement import layout_gpus
    gpus = given or cfg.parallel.gpus or int(os.environ.get("WORLD_SIZE", 0)) or layout_gpus(cfg.parallel, cfg.rollout)
    print(format_plan(plan(cfg, gpus=gpus, gpu_mem_gib=args.gpu_mem_gb)))
    return 0


def _setup_logging(megaflow_level: int, verbose: bool) -> None:
    """megaflow's records from ``megaflow_level`` up; other libraries' from warning up, or (``verbose``)
    everything from info up."""
    import logging
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("megaflow").setLevel(logging.INFO if verbose else megaflow_level)


def _cmd_train(args: argparse.Namespace) -> int:
    from megaflow.rundir.claim import check_run_dir
    if args.dry_run:  # the config and this launch's size, no local files: scripts/launch.sh's DRY_RUN=1
        preflight(load_config(args.config, args.overrides), "train", files=False)
        print(f"[megaflow] --dry-run: the config fits a launch of {os.environ.get('WORLD_SIZE', '1')} process(es)",
              file=sys.stderr)
        return 0
    cfg = load_checked(args, "train")
    overrides = _resume_overrides(args)
    resume = _resume_wanted(cfg, args.resume)
    if os.environ.get("RANK", "0") == "0":
        check_run_dir(cfg, resume=resume, overrides=overrides)
    apply_device(cfg)
    import logging

    from megaflow.run.loop import run
    _setup_logging(logging.INFO, args.verbose)
    hook = {}
    if cfg.eval.every:  # evaluation on the driver: before (fresh runs), every eval.every iterations, after
        from megaflow.commands.evaluation import eval_hook
        hook = dict(evaluate=eval_hook(cfg, run_dir_of(cfg)), evaluate_every=cfg.eval.every)
    metrics = run(cfg, resume=resume, resume_overrides=overrides, verbose=args.verbose,
                  trust_checkpoint=args.trust_checkpoint, **hook)
    if args.json and os.environ.get("RANK", "0") == "0":
        print(json.dumps(metrics, sort_keys=True, default=str))
    return 0


def _resume_arg(text: str) -> str:
    """``--resume``'s value: "auto", or "always" (what a bare --resume means: argparse passes it through here)."""
    if text not in ("auto", "always"):
        raise argparse.ArgumentTypeError(f"expected nothing or 'auto', got {text!r}")
    return text


def _resume_overrides(args: argparse.Namespace) -> tuple[str, ...]:
    """``--resume-override``'s keys: each a config key (``section.key``), and only with ``--resume``."""
    from megaflow.config.keys import config_keys
    keys = tuple(args.resume_override)
    if keys and args.resume is None:
        raise ConfigError("--resume-override is for a resumed run: pass --resume (or --resume auto) too")
    known = {k.dotted for k in config_keys()}
    for key in keys:
        if key not in known:
            raise ConfigError(f"--resume-override {key[:80]!r}: not a config key (section.key, as "
                              "'megaflow config keys' lists them)")
    return keys


def _resume_wanted(cfg, mode: str | None) -> bool:
    """``--resume`` (always), ``--resume auto`` (when the run dir holds a checkpoint: a requeued job continues,
    a first one starts; every rank decides the same before anything is written) or neither."""
    if mode != "auto":
        return mode == "always"
    from megaflow.rundir.checkpoints import list_checkpoints
    found = list_checkpoints(run_dir_of(cfg))
    if os.environ.get("RANK", "0") == "0":
        print(f"[megaflow] --resume auto: {f'resuming from iteration {found[-1][0]}' if found else 'no checkpoint'} "
              f"in {run_dir_of(cfg)}{'' if found else ', starting fresh'}", flush=True)
    return bool(found)


def _cmd_demo(args: argparse.Namespace) -> int:
    import logging
    cfg = run_config(args, "demo")
    from megaflow.commands.demo import run_demo
    _setup_logging(logging.WARNING, args.verbose)
    run_demo(cfg, verbose=args.verbose)
    return 0


def _cmd_pretrain(args: argparse.Namespace) -> int:
    cfg = run_config(args, "pretrain")
    from megaflow.pretrain.loop import run
    result = run(cfg)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from megaflow.commands.export import export_run
    result = export_run(args.run, args.out, iteration=args.iteration, ema=args.ema, lora_only=args.lora_only,
                        max_shard_size=args.max_shard_size, trust_checkpoint=args.trust_checkpoint,
                        base_model=args.base_model, trust_remote_code=args.trust_remote_code)
    print_json(result, args.json)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megaflow", description="megaflow: RL post-training of flow-matching diffusion transformers (FlowGRPO, DiffusionNFT; megatron-core trainer, SGLang rollout).")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_config_parsers(sub)
    _add_run_parsers(sub)
    _add_export_parser(sub)
    add_bench_parsers(sub)
    add_eval_parsers(sub)
    return parser


def _add_config_parsers(sub) -> None:
    """``megaflow config show`` and ``megaflow plan``: a config read and checked, nothing started."""
    p_cfg = sub.add_parser("config", help="Inspect configs.")
    cfg_sub = p_cfg.add_subparsers(dest="config_command", required=True)
    p_show = cfg_sub.add_parser("show", help="Validate a run file with overrides and print the resolved TOML.")
    add_config_args(p_show)
    p_show.add_argument("--no-files", action="store_true",
                        help="Skip the checks of files the config names (model.pretrained, a data.prompts file): "
                        "show a config for a machine where its weights live.")
    p_show.set_defaults(handler=_cmd_config_show)
    p_keys = cfg_sub.add_parser("keys", help="Every config key: its type, default, valid range or choices, and "
                                "what it does.")
    p_keys.add_argument("words", nargs="*", metavar="WORD", help="Only the keys whose name or help holds every "
                        "WORD, e.g. 'rollout' or 'learning rate'.")
    p_keys.set_defaults(handler=_cmd_config_keys)

    p_plan = sub.add_parser("plan", help="GPU memory per rank of a run (weights, grads, optimizer, activations with "
                            "and without recompute, KL reference, engines, reward models on a GPU) and whether it fits; "
                            "nothing starts.")
    add_config_args(p_plan)
    p_plan.add_argument("--gpus", type=int, default=0,
                        help="GPUs of the launch (default: the config's parallel.gpus, else WORLD_SIZE if set, else "
                        "parallel.tp * pp * cp plus rollout.engine_ranks).")
    p_plan.add_argument("--gpu-mem-gb", type=float, default=80.0, help="Memory per GPU in GiB (default 80).")
    p_plan.set_defaults(handler=_cmd_plan)


def _add_run_parsers(sub) -> None:
    """``megaflow train``, ``demo`` and ``pretrain``: the commands that run a config."""
    p_train = sub.add_parser("train", help="RL training (algo.name: flowgrpo, nft, awm or dgpo): SGLang rollouts -> rewards -> "
                             "megatron step -> weight sync. Under torchrun every rank runs it; rank 0 drives the engines.")
    add_config_args(p_train)
    p_train.add_argument("--json", action="store_true", help="Print the last iteration's metrics as JSON.")
    p_train.add_argument("--resume", nargs="?", const="always", type=_resume_arg, default=None, metavar="auto",
                         help="Continue the run in <run.output_dir>/<run.name> from its latest checkpoint. The "
                         "config may change evaluation, logging, the learning rate and its schedule, iterations, "
                         "save cadence and timeouts (listed in one line at start); any other change is refused "
                         "naming the key. '--resume auto': continue when that run dir has a checkpoint, else start "
                         "fresh (a requeued job). Without it, a run dir with checkpoints is refused.")
    p_train.add_argument("--resume-override", action="append", default=[], metavar="SECTION.KEY",
                         help="With --resume: accept a change of this key though it changes what the run trains "
                         "(e.g. rollout.group_size); repeatable.")
    p_train.add_argument("--trust-checkpoint", action="store_true", help=f"With --resume: {TRUST_HELP}")
    p_train.add_argument("--dry-run", action="store_true", help="Check the config against this launch's size "
                         "(WORLD_SIZE, LOCAL_WORLD_SIZE) and exit; local files are not checked.")
    add_trust_remote_code_arg(p_train, sets_config=True)
    add_verbose_arg(p_train)
    p_train.set_defaults(handler=_cmd_train)

    p_demo = sub.add_parser("demo", help="Held-out ShapeEval before -> RL on TRAIN prompts (the config's algorithm) "
                            "-> held-out ShapeEval after, from the shipped model; writes <run dir>/summary.json.")
    add_config_args(p_demo, default="configs/shapes_demo.toml")
    add_trust_remote_code_arg(p_demo, sets_config=True)
    add_verbose_arg(p_demo)
    p_demo.set_defaults(handler=_cmd_demo)

    p_pre = sub.add_parser("pretrain", help="Supervised rectified-flow pretraining of the ShapeEval pipeline "
                           "(text encoders, VAE, then the DiT through megatron-core); writes <run dir>/pipeline.")
    add_config_args(p_pre)
    p_pre.add_argument("--json", action="store_true", help="Print the last evaluation as JSON.")
    add_trust_remote_code_arg(p_pre, sets_config=True)
    p_pre.set_defaults(handler=_cmd_pretrain)


def _add_export_parser(sub) -> None:
    p_exp = sub.add_parser("export", help="Write a run's checkpoint as a diffusers pipeline: the run's pipeline "
                           "with the transformer weights replaced by the checkpoint's, every other component copied.")
    p_exp.add_argument("--run", type=Path, required=True, help="Run dir (<run.output_dir>/<run.name>).")
    p_exp.add_argument("--iteration", type=int, default=None, help="Checkpoint iteration (default: the latest).")
    p_exp.add_argument("--out", type=Path, required=True, help="New pipeline dir (must not exist or be empty).")
    p_exp.add_argument("--no-ema", dest="ema", action="store_false",
                       help="Export the trained weights, not their EMA (a run with train.ema_decay > 0 exports the EMA).")
    p_exp.add_argument("--lora-only", action="store_true", help="A LoRA run: write only "
                       "pytorch_lora_weights.safetensors and a README.md model card (base pipeline, rank, alpha, "
                       "targets); refused for a full-parameter run.")
    p_exp.add_argument("--base-model", default=None, metavar="ID", help="The base model's hub "
                       "id for the model card's base_model (e.g. stabilityai/stable-diffusion-3.5-medium; default: "
                       "the base pipeline directory's name).")
    p_exp.add_argument("--max-shard-size", default="5GB", help="Largest transformer weights file (e.g. 500MB, "
                       "5GB, 2GiB); a larger transformer is written in shards with an index.json, as diffusers does.")
    p_exp.add_argument("--json", action="store_true", help="Print one JSON object.")
    p_exp.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    p_exp.add_argument("--trust-remote-code", action="store_true", help="Export a run whose pipeline names code "
                       "(a config's auto_map, a custom class in model_index.json): the export copies it along; "
                       "without it such a pipeline is refused.")
    p_exp.set_defaults(handler=_cmd_export)


def _quiet_third_party() -> None:
    """Warnings and progress bars from the stack's own internals (megatron, sglang, torch, ...) say nothing a
    user can act on: filter them once, here, for this process and the engine workers it starts."""
    import logging
    import warnings
    for mod in ("megatron", "sglang", "torch", "transformers", "diffusers", "apex", "transformer_engine", "triton"):
        warnings.filterwarnings("ignore", module=mod)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' "Writing model shards" bars
    # megatron's DDP/optimizer setup warnings; torch's "No CUDA runtime is found" on CPU machines
    for name in ("megatron", "torch.utils.cpp_extension"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _command_environment() -> None:
    """What every ``megaflow`` command runs with, unless the caller set it (``import megaflow`` sets nothing):
    offline hubs (every model is a local directory; the libraries never wait on a network) and tokenizers
    without their own thread pool (engine workers fork)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _no_collection_at_exit() -> None:
    """At exit, ``gc.freeze`` first so the last collections skip the libraries' objects (docs/design/run.md)."""
    import atexit
    import gc
    atexit.unregister(gc.freeze)  # once per process, however often main runs in it
    atexit.register(gc.freeze)


def main(argv: list[str] | None = None) -> int:
    _command_environment()
    _no_collection_at_exit()
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "verbose", False):
        _quiet_third_party()
    handler: Handler = args.handler
    scores_rewards = args.command in ("train", "demo") or getattr(args, "eval_command", None) in ("reward", "video")
    before = child_pids() if scores_rewards else None
    if scores_rewards:
        adopt_orphans()  # a reward's double-forked helper stays ours: kill_children below ends it too
    try:
        return handler(args)
    except ConfigError as e:
        print(f"megaflow: config error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"megaflow: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"megaflow: error: {e}", file=sys.stderr)  # a full disk (a checkpoint says what it needed)
        return 1
    except Interrupted as e:
        print(f"megaflow: {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt as e:  # a plain Ctrl-C, or Abandoned (a second signal) with its signal
        print("megaflow: interrupted (engines shut down, no checkpoint written)", file=sys.stderr)
        return 128 + getattr(e, "signum", 2)
    finally:
        if before is not None:  # what a reward started (e.g. on a call abandoned at its timeout) ends with us
            kill_children(spare=before)

