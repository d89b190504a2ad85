"""``megaflow eval shapes`` and ``megaflow eval reward``: their parsers and handlers (scores of images; ``eval video``
is in ``evaluate_video.py``). Heavy imports happen inside the handlers.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from megaflow.cli.common import add_config_args, add_trust_remote_code_arg, print_json
from megaflow.cli.evaluate_video import add_video_parser
from megaflow.config import load_config
from megaflow.shapeeval import SAMPLERS


def _cmd_eval_shapes(args: argparse.Namespace) -> int:
    from megaflow.shapeeval.score import evaluate_corruption, evaluate_ground_truth, evaluate_images
    if args.pipeline is not None:
        from megaflow.config.files import check_pipeline
        from megaflow.config.remote_code import refuse_custom_components, refuse_remote_code
        check_pipeline(args.pipeline, "--pipeline")
        refuse_remote_code(args.pipeline, "--pipeline", trust=args.trust_remote_code)
        if args.sampler == "sglang":
            refuse_custom_components(args.pipeline, "--pipeline")
        from megaflow.shapeeval.evaluate import brief, evaluate_pipeline
        out_dir = args.out or Path("runs") / f"{args.pipeline.resolve().name}-shapeeval"
        result = brief(evaluate_pipeline(args.pipeline, num=args.num, num_seen=args.num_seen, seed=args.seed,
                                         num_steps=args.steps, resolution=args.resolution, out_dir=out_dir,
                                         sampler=args.sampler, trust_remote_code=args.trust_remote_code))
        print_json(result, True)
        return 0
    if args.ground_truth:
        result = evaluate_ground_truth(args.num, seed=args.seed, resolution=args.resolution)
    elif args.corrupt:
        result = evaluate_corruption(args.corrupt, args.num, seed=args.seed, resolution=args.resolution)
    elif args.images:
        result = evaluate_images(args.images)
    else:
        raise ValueError("eval shapes needs --pipeline DIR, --images DIR, --ground-truth or --corrupt KIND")
    print_json(result, args.json)
    return 0


def _cmd_eval_reward(args: argparse.Namespace) -> int:
    from megaflow.config.manifest import check_reward_args, read_manifest
    from megaflow.shapeeval.score import check_image_files
    if not args.timeout_s >= 0:
        raise ValueError(f"--timeout-s {args.timeout_s}: want seconds >= 0 (0 = no limit)")
    reward, base = _reward_of_config(args)
    kwargs = check_reward_args(reward, args.kwargs, base)
    entries = read_manifest(args.images)  # one-line errors before torch loads
    check_image_files([e.path for e in entries])
    from megaflow.rewards.folder import score_folder
    result = score_folder(entries, reward, kwargs, timeout_s=args.timeout_s)
    if args.json:
        print(json.dumps({"reward": reward, "files": result["files"], "scores": result["scores"],
                          "mean": result["mean"], "masked": result["masked"]}))
    else:
        fmt = lambda s: "masked" if s is None else f"{s:.4f}"  # noqa: E731
        for file, prompt, score in zip(result["files"], result["prompts"], result["scores"]):
            print(f"{fmt(score)}  {file}  {prompt}")
        print(f"mean {reward}: {fmt(result['mean'])} over {len(entries) - result['masked']} of {len(entries)} "
              "images")
    return 0


def _reward_of_config(args: argparse.Namespace) -> tuple[str, dict]:
    """``eval reward``'s reward and its settings: ``--reward`` (or the one reward of ``-c``'s reward.weights) with
    the config's ``reward.kwargs`` for it, which ``--kwargs`` then updates."""
    if args.config is None:
        if args.overrides:
            raise ValueError("--set needs -c CONFIG (the config whose reward settings it changes)")
        if args.reward is None:
            raise ValueError("--reward NAME is needed (or -c CONFIG with one reward in reward.weights)")
        return args.reward, {}
    cfg = load_config(args.config, args.overrides)
    reward = args.reward
    if reward is None:
        if len(cfg.reward.weights) != 1:
            raise ValueError(f"-c {args.config}: reward.weights names {len(cfg.reward.weights)} rewards "
                             f"({', '.join(cfg.reward.weights)}): choose one with --reward")
        (reward,) = cfg.reward.weights
    return reward, dict(cfg.reward.kwargs.get(reward, {}))


def add_eval_parsers(sub) -> None:
    """``megaflow eval shapes``, ``megaflow eval reward`` and ``megaflow eval video``: scores of images and clips."""
    p_eval = sub.add_parser("eval", help="Evaluate images and clips.")
    eval_sub = p_eval.add_subparsers(dest="eval_command", required=True)
    p_shapes = eval_sub.add_parser("shapes", help="ShapeEval: score generated images, or the checker's ceiling "
                                   "on ground-truth renders.")
    p_shapes.add_argument("--pipeline", type=Path, default=None,
                          help="Diffusers pipeline dir: sample --num held-out prompts (+ --num-seen of the categories "
                          "too small to split) through the --sampler, ODE, fixed seeds; prints JSON with 95%% "
                          "intervals and saves the images, manifest and grid to --out.")
    p_shapes.add_argument("--num-seen", type=int, default=60, help="Seen-category prompts with --pipeline.")
    p_shapes.add_argument("--steps", type=int, default=10, help="Sampling steps with --pipeline.")
    p_shapes.add_argument("--sampler", choices=SAMPLERS, default=SAMPLERS[0],
                          help="With --pipeline: sample through an SGLang engine, or through diffusers' own "
                               "StableDiffusion3Pipeline call (its scheduler; prompts encoded as the engine does), "
                               "an independent check of the engine's figures.")
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
    add_trust_remote_code_arg(p_shapes)
    p_shapes.set_defaults(handler=_cmd_eval_shapes)
    p_rew = eval_sub.add_parser("reward", help="Score a folder of images with one reward: per-image scores and "
                                "their mean.")
    p_rew.add_argument("--reward", default=None, help="A built-in reward name (as in reward.weights) or "
                       "'pkg.module:callable'; with -c, default: the config's one reward.")
    add_config_args(p_rew)
    p_rew.add_argument("--kwargs", default=None, metavar="JSON", help="The reward's keyword arguments as a JSON "
                       "object, e.g. '{\"threads\": 2}'; with -c they update the config's reward.kwargs for it.")
    p_rew.add_argument("--images", type=Path, required=True, help="Folder with manifest.jsonl: one {\"file\", "
                       "\"prompt\", ...} a line; the other keys are that image's metadata.")
    p_rew.add_argument("--json", action="store_true", help='Print one JSON object {"reward", "files": [...], '
                       '"scores": [...], "mean", "masked"} (a score is null for an image the reward failed on).')
    p_rew.add_argument("--timeout-s", type=float, default=600.0, help="Seconds the reward may take for the whole "
                       "folder (default 600; 0 = no limit): a call still running then is abandoned, and it and the "
                       "images not scored yet are null. No image scored at all is an error (exit 2).")
    p_rew.set_defaults(handler=_cmd_eval_reward)
    add_video_parser(eval_sub)
