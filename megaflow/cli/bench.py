"""``megaflow bench ...``: the benchmark subcommands (each prints / writes one JSON object)."""
from __future__ import annotations

import argparse
from pathlib import Path

from megaflow.cli.common import add_config_args, emit, load_checked, run_config


def _cmd_bench_train(args: argparse.Namespace) -> int:
    from megaflow.bench.train import bench_train
    emit(bench_train(batch=args.batch, repeats=args.repeats, warmup=args.warmup), args)
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
    emit(result, args)
    return 0


def _cmd_bench_hosts(args: argparse.Namespace) -> int:
    load_checked(args, "train")  # one-line errors before two launches start
    from megaflow.bench.loops import bench_hosts
    emit(bench_hosts(args.config, args.overrides, iterations=args.iterations), args)
    return 0


def _cmd_bench_async(args: argparse.Namespace) -> int:
    load_checked(args, "train")
    from megaflow.bench.loops import bench_async
    emit(bench_async(args.config, args.overrides, iterations=args.iterations), args)
    return 0


def _cmd_bench_sync(args: argparse.Namespace) -> int:
    if args.params is not None and not 1e5 <= args.params <= 2e10:
        raise ValueError(f"bench sync: --params must be between 1e5 and 2e10, got {args.params:g}")
    from megaflow.bench.sync import bench_sync
    emit(bench_sync(layers=args.layers, heads=args.heads, head_dim=args.head_dim, params=args.params,
                    engines=args.engines, repeats=args.repeats, warmup=args.warmup, bucket_mb=args.bucket_mb,
                    tiny=not args.no_tiny, checksum=args.checksum, precision=args.precision), args)
    return 0


PLAIN_ALGORITHMS = ("flowgrpo", "nft")
"""The algorithms the plain loop of ``bench learn`` has (megaflow.bench.plain.plain_algorithm)."""


def _cmd_bench_learn(args: argparse.Namespace) -> int:
    if args.reuse and not args.algos:
        raise ValueError("bench learn: --reuse needs --algos (it names some of them)")
    if args.algos:
        from megaflow.bench.leaderboard import leaderboard
        algos = [a for a in args.algos.split(",") if a]
        emit(leaderboard(algos, config_dir=Path(args.config).parent, overrides=args.overrides,
                         out_dir=Path(args.out_dir), eval_every=args.eval_every, eval_num=args.eval_num,
                         reuse=[a for a in args.reuse.split(",") if a]), args)
        return 0
    cfg = run_config(args, "train")
    if args.side != "megaflow" and cfg.algo.name not in PLAIN_ALGORITHMS:
        raise ValueError(f"bench learn: the plain baseline has no algo.name = {cfg.algo.name!r} (it has "
                         f"{', '.join(PLAIN_ALGORITHMS)}); run it with --side megaflow")
    from megaflow.bench.learn import bench_learn
    emit(bench_learn(cfg, side=args.side, eval_every=args.eval_every, eval_num=args.eval_num,
                      target_gain=args.target_gain), args)
    return 0


def add_bench_parsers(sub) -> None:
    """The ``bench`` subcommand and its own subcommands on ``sub`` (the top-level subparsers)."""
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
                                "copy of the same bytes, with each phase's GB/s: a scaled-up random SD3 DiT and the "
                                "tiny one.")
    p_bs.add_argument("--layers", type=int, default=6, help="Joint blocks of the large DiT.")
    p_bs.add_argument("--heads", type=int, default=12, help="Attention heads of the large DiT.")
    p_bs.add_argument("--head-dim", type=int, default=64, help="Head width of the large DiT.")
    p_bs.add_argument("--params", type=float, default=None, help="About this many parameters (e.g. 1e9) in SD3-like "
                      "shapes (head width 64; 12 heads below 4e8, else 24; the nearest block count), in place of "
                      "--layers / --heads / --head-dim.")
    p_bs.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="dtype of the large DiT's "
                      "weights and of its engine.")
    p_bs.add_argument("--engines", type=int, default=1, help="SGLang engines synced at once.")
    p_bs.add_argument("--repeats", type=int, default=5, help="Timed pushes (the median is reported).")
    p_bs.add_argument("--warmup", type=int, default=1, help="Untimed pushes first.")
    p_bs.add_argument("--bucket-mb", type=float, default=64.0, help="Bucket size, MiB.")
    p_bs.add_argument("--checksum", choices=("xxh3", "sha256"), default="xxh3", help="bridge.checksum of the syncs.")
    p_bs.add_argument("--no-tiny", action="store_true", help="Skip the tiny model.")
    p_bl = bench_sub.add_parser("learn", help="The demo's RL recipe through a plain diffusers + torch loop vs "
                                "megaflow; held-out ShapeEval before/after, reward curves, RL wall time.")
    add_config_args(p_bl, default="configs/shapes_demo.toml")
    p_bl.add_argument("--side", choices=("baseline", "megaflow", "both"), default="both")
    p_bl.add_argument("--eval-every", type=int, default=0, help="Held-out eval every N iterations (0 = off).")
    p_bl.add_argument("--eval-num", type=int, default=100, help="Held-out prompts of those intermediate evals.")
    p_bl.add_argument("--target-gain", type=float, default=0.05, help="Report the RL time to this held-out gain.")
    p_bl.add_argument("--algos", default="", help="Comma-separated algorithms (flowgrpo, nft, awm, dgpo): each runs "
                      "its own recipe, configs/shapes_demo_<algo>.toml (nft: shapes_demo.toml) from -c's directory, "
                      "megaflow side only, one after the other, with the same --set overrides; a leaderboard table, "
                      "plot and JSON result.")
    p_bl.add_argument("--out-dir", default="runs/leaderboard", help="With --algos: where each algorithm's report, "
                      "leaderboard.md and leaderboard.png go.")
    p_bl.add_argument("--reuse", default="", help="With --algos: comma-separated algorithms whose report from an "
                      "earlier run in --out-dir is tabulated instead of running them again; refused if a recipe or "
                      "evaluation field it recorded differs from today's config.")
    p_bh = bench_sub.add_parser("hosts", help="Whole-loop images/s of megaflow train with 2 engine hosts / 1 "
                                "(two torchrun runs on this machine, rollout.engine_hosts = rank).")
    add_config_args(p_bh, default="configs/cpu_demo.toml")
    p_bh.add_argument("--iterations", type=int, default=6, help="Iterations per run (the first is not timed).")
    p_ba = bench_sub.add_parser("async", help="Whole-loop images/s of megaflow train with train.max_staleness = 1 "
                                "/ 0 (two runs of the config on this machine, one process each).")
    add_config_args(p_ba, default="configs/shapes_demo.toml")
    p_ba.add_argument("--iterations", type=int, default=12, help="Iterations per run (the first is not timed).")
    for p, handler in ((p_bt, _cmd_bench_train), (p_br, _cmd_bench_rollout), (p_bs, _cmd_bench_sync),
                       (p_bl, _cmd_bench_learn), (p_bh, _cmd_bench_hosts), (p_ba, _cmd_bench_async)):
        p.add_argument("--json", action="store_true", help="Print one JSON object.")
        p.add_argument("--out", default=None, help="Also write the JSON to this file.")
        p.set_defaults(handler=handler)
