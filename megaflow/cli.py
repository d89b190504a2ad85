"""The ``megaflow`` command line. argparse lives here only: no Namespace escapes this file.

Subcommands call plain functions with keyword arguments; heavy imports (torch, megatron, sglang)
happen inside the handlers so ``megaflow --help`` is instant.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from megaflow.config import ConfigError, MegaflowConfig, dump_config, load_config
from megaflow.config.preflight import preflight
from megaflow.run.interrupt import Interrupted

Handler = Callable[[argparse.Namespace], int]
TRUST_HELP = "Load a checkpoint lacking MANIFEST.json unchecked (torch unpickles it): only from a trusted source."


def _add_config_args(p: argparse.ArgumentParser, default: str | None = None) -> None:
    p.add_argument("--config", "-c", default=default, help="TOML run file (configs/*.toml)"
                   + (f"; default {default}." if default else "."))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="Override one config value (repeatable), e.g. --set parallel.tp=2.")


def _load_checked(args: argparse.Namespace, command: str) -> MegaflowConfig:
    """The validated config of ``-c`` / ``--set``, preflight-checked for ``command`` (files it names,
    the machine, cross-field rules) before anything heavy is imported."""
    return preflight(load_config(args.config, args.overrides), command)


def _apply_device(cfg: MegaflowConfig) -> MegaflowConfig:
    """Apply ``run.device`` to this process and the engine workers it starts
    (megaflow.parallel.distributed.select_device) before anything touches CUDA."""
    from megaflow.parallel.distributed import select_device
    select_device(cfg.run.device)
    return cfg


def _run_config(args: argparse.Namespace, command: str) -> MegaflowConfig:
    """The checked config of a command that computes, with ``run.device`` applied."""
    return _apply_device(_load_checked(args, command))


def _add_verbose_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", "-v", action="store_true",
                   help="Show the SGLang engines' logs (per-stage timings of every call), third-party info logs "
                   "and warnings on the terminal, with no progress bar; by default engine logs go to "
                   "<run dir>/logs/engine<i>.log.")


def _cmd_config_show(args: argparse.Namespace) -> int:
    cfg = preflight(load_config(args.config, args.overrides), "show", files=not args.no_files)
    print(dump_config(cfg), end="")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from megaflow.plan.memory import check_plan_args, format_plan, plan
    given = check_plan_args(args.gpus, args.gpu_mem_gb)
    cfg = preflight(load_config(args.config, args.overrides), "show", files=False)
    p = cfg.parallel
    gpus = given or int(os.environ.get("WORLD_SIZE", p.tp * p.pp * p.cp))
    print(format_plan(plan(cfg, gpus=gpus, gpu_mem_gib=args.gpu_mem_gb)))
    return 0


def _print_json(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, sort_keys=True))
    else:
        for k, v in result.items():
            print(f"{k}: {v}")


def _cmd_eval_shapes(args: argparse.Namespace) -> int:
    from megaflow.shapeeval.score import evaluate_corruption, evaluate_ground_truth, evaluate_images
    if args.pipeline is not None:
        from megaflow.config.files import check_pipeline
        check_pipeline(args.pipeline, "--pipeline")
        from megaflow.shapeeval.evaluate import brief, evaluate_pipeline
        out_dir = args.out or Path("runs") / f"{args.pipeline.resolve().name}-shapeeval"
        result = brief(evaluate_pipeline(args.pipeline, num=args.num, num_seen=args.num_seen, seed=args.seed,
                                         num_steps=args.steps, resolution=args.resolution, out_dir=out_dir))
        _print_json(result, True)
        return 0
    if args.ground_truth:
        result = evaluate_ground_truth(args.num, seed=args.seed, resolution=args.resolution)
    elif args.corrupt:
        result = evaluate_corruption(args.corrupt, args.num, seed=args.seed, resolution=args.resolution)
    elif args.images:
        result = evaluate_images(args.images)
    else:
        raise ValueError("eval shapes needs --pipeline DIR, --images DIR, --ground-truth or --corrupt KIND")
    _print_json(result, args.json)
    return 0


def _cmd_eval_reward(args: argparse.Namespace) -> int:
    from megaflow.config.manifest import check_reward_args, read_manifest
    kwargs = check_reward_args(args.reward, args.kwargs)
    entries = read_manifest(args.images)  # one-line errors before torch loads
    from megaflow.rewards.folder import score_folder
    result = score_folder(entries, args.reward, kwargs)
    if args.json:
        print(json.dumps({"scores": result["scores"], "mean": result["mean"]}))
        return 0
    fmt = lambda s: "masked" if s is None else f"{s:.4f}"  # noqa: E731
    for file, prompt, score in zip(result["files"], result["prompts"], result["scores"]):
        print(f"{fmt(score)}  {file}  {prompt}")
    print(f"mean {args.reward}: {fmt(result['mean'])} over {len(entries) - result['masked']} of {len(entries)} images")
    return 0


def _setup_logging(megaflow_level: int, verbose: bool) -> None:
    """megaflow's records from ``megaflow_level`` up; other libraries' from warning up, or (``verbose``)
    everything from info up."""
    import logging
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("megaflow").setLevel(logging.INFO if verbose else megaflow_level)


def _cmd_train(args: argparse.Namespace) -> int:
    from megaflow.run.rundir import check_run_dir
    cfg = _load_checked(args, "train")
    if os.environ.get("RANK", "0") == "0":
        check_run_dir(cfg, resume=args.resume)
    _apply_device(cfg)
    import logging

    from megaflow.run.loop import run
    _setup_logging(logging.INFO, args.verbose)
    metrics = run(cfg, resume=args.resume, verbose=args.verbose, trust_checkpoint=args.trust_checkpoint)
    if args.json and os.environ.get("RANK", "0") == "0":
        print(json.dumps(metrics, sort_keys=True, default=str))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    import logging
    cfg = _run_config(args, "demo")
    from megaflow.run.demo import run_demo
    _setup_logging(logging.WARNING, args.verbose)
    run_demo(cfg, verbose=args.verbose)
    return 0


def _cmd_pretrain(args: argparse.Namespace) -> int:
    cfg = _run_config(args, "pretrain")
    from megaflow.pretrain.loop import run
    result = run(cfg)
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from megaflow.run.export import export_run
    result = export_run(args.run, args.out, iteration=args.iteration, ema=args.ema, lora_only=args.lora_only,
                        max_shard_size=args.max_shard_size, trust_checkpoint=args.trust_checkpoint)
    _print_json(result, args.json)
    return 0


def _emit(result: dict, args: argparse.Namespace) -> None:
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, sort_keys=True, indent=2) + "\n")
    _print_json(result, args.json)


def _cmd_bench_train(args: argparse.Namespace) -> int:
    from megaflow.bench.train import bench_train
    _emit(bench_train(batch=args.batch, repeats=args.repeats, warmup=args.warmup), args)
    return 0


def _cmd_bench_rollout(args: argparse.Namespace) -> int:
    import tempfile

    from megaflow.bench.rollout import bench_rollout
    engines = tuple(int(x) for x in args.engines.split(","))
    with tempfile.TemporaryDirectory(prefix="megaflow-bench-") as tmp:
        pipeline = args.pipeline
        if pipeline is None:
            from megaflow.models.tiny_pipeline import make_tiny_pipeline
            pipeline = str(make_tiny_pipeline("sd3", Path(tmp) / "tiny-sd3", seed=0))
        result = bench_rollout(pipeline, engines=engines, groups=args.groups, group_size=args.group_size,
                               steps=args.steps, res=args.res, repeats=args.repeats, baseline_threads=args.threads)
    _emit(result, args)
    return 0


def _cmd_bench_hosts(args: argparse.Namespace) -> int:
    _load_checked(args, "train")  # one-line errors before two launches start
    from megaflow.bench.hosts import bench_hosts
    _emit(bench_hosts(args.config, args.overrides, iterations=args.iterations), args)
    return 0


def _cmd_bench_sync(args: argparse.Namespace) -> int:
    from megaflow.bench.sync import bench_sync
    _emit(bench_sync(layers=args.layers, heads=args.heads, head_dim=args.head_dim, engines=args.engines, tiny=not
                     args.no_tiny, repeats=args.repeats, warmup=args.warmup, bucket_mb=args.bucket_mb,
                     checksum=args.checksum), args)
    return 0


def _cmd_bench_learn(args: argparse.Namespace) -> int:
    cfg = _run_config(args, "train")
    from megaflow.bench.learn import bench_learn
    _emit(bench_learn(cfg, side=args.side, eval_every=args.eval_every, eval_num=args.eval_num,
                      target_gain=args.target_gain), args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megaflow", description="megaflow: FlowGRPO post-training of diffusion transformers (megatron-core trainer, SGLang rollout).")
    sub = parser.add_subparsers(dest="command", required=True)

    p_cfg = sub.add_parser("config", help="Inspect configs.")
    cfg_sub = p_cfg.add_subparsers(dest="config_command", required=True)
    p_show = cfg_sub.add_parser("show", help="Validate a run file with overrides and print the resolved TOML.")
    _add_config_args(p_show)
    p_show.add_argument("--no-files", action="store_true",
                        help="Skip the checks of files the config names (model.pretrained, a data.prompts file): "
                        "show a config for a machine where its weights live.")
    p_show.set_defaults(handler=_cmd_config_show)

    p_plan = sub.add_parser("plan", help="GPU memory per rank of a run (weights, grads, optimizer, activations with "
                            "and without recompute, KL reference, engines) and whether it fits; nothing starts.")
    _add_config_args(p_plan)
    p_plan.add_argument("--gpus", type=int, default=0,
                        help="GPUs of the launch (default: WORLD_SIZE if set, else parallel.tp * pp * cp).")
    p_plan.add_argument("--gpu-mem-gb", type=float, default=80.0, help="Memory per GPU in GiB (default 80).")
    p_plan.set_defaults(handler=_cmd_plan)

    p_train = sub.add_parser("train", help="FlowGRPO training: SGLang rollouts -> rewards -> megatron step -> "
                             "weight sync. Under torchrun every rank runs it; rank 0 drives the engines.")
    _add_config_args(p_train)
    p_train.add_argument("--json", action="store_true", help="Print the last iteration's metrics as JSON.")
    p_train.add_argument("--resume", action="store_true",
                         help="Continue the run in <run.output_dir>/<run.name> from its latest checkpoint (same "
                         "config; train.iterations may grow). Without it, a run dir with checkpoints is refused.")
    p_train.add_argument("--trust-checkpoint", action="store_true", help=f"With --resume: {TRUST_HELP}")
    _add_verbose_arg(p_train)
    p_train.set_defaults(handler=_cmd_train)

    p_demo = sub.add_parser("demo", help="Held-out ShapeEval before -> FlowGRPO on TRAIN prompts -> held-out "
                            "ShapeEval after, from the shipped model; writes <run dir>/summary.json.")
    _add_config_args(p_demo, default="configs/shapes_demo.toml")
    _add_verbose_arg(p_demo)
    p_demo.set_defaults(handler=_cmd_demo)

    p_pre = sub.add_parser("pretrain", help="Supervised rectified-flow pretraining of the ShapeEval pipeline "
                           "(text encoders, VAE, then the DiT through megatron-core); writes <run dir>/pipeline.")
    _add_config_args(p_pre)
    p_pre.add_argument("--json", action="store_true", help="Print the last evaluation as JSON.")
    p_pre.set_defaults(handler=_cmd_pretrain)

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
    p_exp.add_argument("--max-shard-size", default="5GB", help="Largest transformer weights file (e.g. 500MB, "
                       "5GB, 2GiB); a larger transformer is written in shards with an index.json, as diffusers does.")
    p_exp.add_argument("--json", action="store_true", help="Print one JSON object.")
    p_exp.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    p_exp.set_defaults(handler=_cmd_export)

    p_bench = sub.add_parser("bench", help="Benchmarks (print / write one JSON object).")
    bench_sub = p_bench.add_subparsers(dest="bench_command", required=True)
    p_bt = bench_sub.add_parser("train", help="megaflow megatron SFT step vs diffusers SD3 step, same weights, TP=1.")
    p_bt.add_argument("--batch", type=int, default=8)
    p_bt.add_argument("--warmup", type=int, default=3)
    p_bt.add_argument("--repeats", type=int, default=10)
    p_br = bench_sub.add_parser("rollout", help="Images/s of 1 and 2 SGLang engines vs a batched diffusers loop.")
    p_br.add_argument("--pipeline", default=None, help="Diffusers pipeline dir (default: a tiny SD3 made on the fly).")
    p_br.add_argument("--engines", default="1,2", help="Comma-separated engine counts.")
    p_br.add_argument("--groups", type=int, default=2)
    p_br.add_argument("--group-size", type=int, default=8)
    p_br.add_argument("--steps", type=int, default=4)
    p_br.add_argument("--res", type=int, default=64)
    p_br.add_argument("--repeats", type=int, default=5)
    p_br.add_argument("--threads", type=int, default=1,
                      help="Torch threads of the baseline loop and of each engine worker (equal on both sides).")
    p_bs = bench_sub.add_parser("sync", help="Weight-sync seconds into SGLang engines (verify off / on) vs a plain "
                                "copy of the same bytes: a scaled-up random SD3 DiT and the tiny one.")
    p_bs.add_argument("--layers", type=int, default=6, help="Joint blocks of the large DiT.")
    p_bs.add_argument("--heads", type=int, default=12, help="Attention heads of the large DiT.")
    p_bs.add_argument("--head-dim", type=int, default=64, help="Head width of the large DiT.")
    p_bs.add_argument("--engines", type=int, default=1, help="SGLang engines synced at once.")
    p_bs.add_argument("--repeats", type=int, default=5, help="Timed pushes (the median is reported).")
    p_bs.add_argument("--warmup", type=int, default=1, help="Untimed pushes first.")
    p_bs.add_argument("--bucket-mb", type=float, default=64.0, help="Bucket size, MiB.")
    p_bs.add_argument("--checksum", choices=("xxh3", "sha256"), default="xxh3", help="bridge.checksum of the syncs.")
    p_bs.add_argument("--no-tiny", action="store_true", help="Skip the tiny model.")
    p_bl = bench_sub.add_parser("learn", help="The demo's RL recipe through a plain diffusers + torch loop vs "
                                "megaflow; held-out ShapeEval before/after, reward curves, RL wall time.")
    _add_config_args(p_bl, default="configs/shapes_demo.toml")
    p_bl.add_argument("--side", choices=("baseline", "megaflow", "both"), default="both")
    p_bl.add_argument("--eval-every", type=int, default=0, help="Held-out eval every N iterations (0 = off).")
    p_bl.add_argument("--eval-num", type=int, default=100, help="Held-out prompts of those intermediate evals.")
    p_bl.add_argument("--target-gain", type=float, default=0.05, help="Report the RL time to this held-out gain.")
    p_bh = bench_sub.add_parser("hosts", help="Whole-loop images/s of megaflow train with 2 engine hosts / 1 "
                                "(two torchrun runs on this machine, rollout.engine_hosts = rank).")
    _add_config_args(p_bh, default="configs/cpu_demo.toml")
    p_bh.add_argument("--iterations", type=int, default=6, help="Iterations per run (the first is not timed).")
    for p, handler in ((p_bt, _cmd_bench_train), (p_br, _cmd_bench_rollout), (p_bs, _cmd_bench_sync),
                       (p_bl, _cmd_bench_learn), (p_bh, _cmd_bench_hosts)):
        p.add_argument("--json", action="store_true", help="Print one JSON object.")
        p.add_argument("--out", default=None, help="Also write the JSON to this file.")
        p.set_defaults(handler=handler)

    p_eval = sub.add_parser("eval", help="Evaluate images.")
    eval_sub = p_eval.add_subparsers(dest="eval_command", required=True)
    p_shapes = eval_sub.add_parser("shapes", help="ShapeEval: score generated images, or the checker's ceiling "
                                   "on ground-truth renders.")
    p_shapes.add_argument("--pipeline", type=Path, default=None,
                          help="Diffusers pipeline dir: sample --num held-out prompts (+ --num-seen of the categories "
                          "too small to split) through an SGLang engine, ODE, fixed seeds; prints JSON with 95%% "
                          "intervals and saves the images, manifest and grid to --out.")
    p_shapes.add_argument("--num-seen", type=int, default=60, help="Seen-category prompts with --pipeline.")
    p_shapes.add_argument("--steps", type=int, default=10, help="Sampling steps with --pipeline.")
    p_shapes.add_argument("--out", type=Path, default=None,
                          help="Where --pipeline writes its images (default: runs/<pipeline name>-shapeeval).")
    p_shapes.add_argument("--images", type=Path, default=None,
                          help="Folder of images; prompts from manifest.jsonl or file names.")
    p_shapes.add_argument("--ground-truth", action="store_true",
                          help="Render --num held-out ground-truth images and score them.")
    p_shapes.add_argument("--corrupt", default=None, metavar="KIND",
                          help="Render corrupted variants (colour, count, position, ...) and score them.")
    p_shapes.add_argument("--num", type=int, default=300, help="Images for --pipeline / --ground-truth / --corrupt.")
    p_shapes.add_argument("--seed", type=int, default=0)
    p_shapes.add_argument("--resolution", type=int, default=32)
    p_shapes.add_argument("--json", action="store_true", help="Print one JSON object.")
    p_shapes.set_defaults(handler=_cmd_eval_shapes)
    p_rew = eval_sub.add_parser("reward", help="Score a folder of images with one reward: per-image scores and "
                                "their mean.")
    p_rew.add_argument("--reward", required=True, help="A built-in reward name (as in reward.weights) or "
                       "'pkg.module:callable'.")
    p_rew.add_argument("--kwargs", default=None, metavar="JSON", help="The reward's keyword arguments as a JSON "
                       "object, e.g. '{\"threads\": 2}'.")
    p_rew.add_argument("--images", type=Path, required=True, help="Folder with manifest.jsonl: one {\"file\", "
                       "\"prompt\", ...} a line; the other keys are that image's metadata.")
    p_rew.add_argument("--json", action="store_true", help='Print one JSON object {"scores": [...], "mean": ...} '
                       "(null for an image the reward failed on).")
    p_rew.set_defaults(handler=_cmd_eval_reward)
    return parser


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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "verbose", False):
        _quiet_third_party()
    handler: Handler = args.handler
    try:
        return handler(args)
    except ConfigError as e:
        print(f"megaflow: config error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"megaflow: error: {e}", file=sys.stderr)
        return 2
    except Interrupted as e:
        print(f"megaflow: {e}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("megaflow: interrupted (engines shut down, no checkpoint written)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
