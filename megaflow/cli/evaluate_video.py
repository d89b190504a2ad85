"""``megaflow eval video``: video ShapeEval of a folder of clips, a Wan pipeline, the ground-truth renderer or its
corruptions, optionally with image rewards per frame. Every argument is checked, in one line, before torch loads.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from megaflow.cli.common import add_trust_remote_code_arg, print_json
from megaflow.config.video_check import FRAME_WORDS
from megaflow.shapeeval import CLIP_CORRUPTIONS, SAMPLERS


def _rewards(args: argparse.Namespace) -> dict[str, dict]:
    """{reward: kwargs} of ``--reward`` / ``--kwargs``, checked (names, arguments, model files) without torch."""
    from megaflow.config.manifest import check_reward_args
    if args.kwargs is not None and len(args.reward) != 1:
        raise ValueError("--kwargs goes with exactly one --reward")
    mode = args.reward_frames
    if mode not in FRAME_WORDS and not mode.isdigit():
        raise ValueError(f"--reward-frames {mode!r}: one of {', '.join(FRAME_WORDS)} or a frame index (\"2\")")
    if mode.isdigit() and args.frames is not None and int(mode) >= args.frames:
        raise ValueError(f"--reward-frames {mode}: the clips have {args.frames} frames (0 .. {args.frames - 1})")
    return {name: check_reward_args(name, args.kwargs) for name in dict.fromkeys(args.reward)}


def _check_pipeline(args: argparse.Namespace) -> None:
    from megaflow.config.files import check_pipeline
    from megaflow.config.remote_code import refuse_custom_components, refuse_remote_code
    from megaflow.families import card
    configs = check_pipeline(args.pipeline, "--pipeline")
    want = card("wan").diffusers_class
    if configs["transformer"].get("_class_name") != want:
        raise ValueError(f"--pipeline {args.pipeline}: its transformer is {configs['transformer'].get('_class_name')!r}"
                         f", eval video samples Wan 2.1 pipelines ({want})")
    step = card("wan").temporal_compression
    if (args.frames - 1) % step:
        raise ValueError(f"--frames {args.frames}: Wan's VAE takes k * {step} + 1 frames (e.g. 5 or 9)")
    refuse_remote_code(args.pipeline, "--pipeline", trust=args.trust_remote_code)
    if args.sampler == "sglang":
        refuse_custom_components(args.pipeline, "--pipeline")


def _check_sizes(args: argparse.Namespace) -> None:
    from megaflow.shapeeval.video_render import motion_step
    if args.num < 1:
        raise ValueError(f"--num {args.num}: want >= 1")
    if args.resolution < 16:
        raise ValueError(f"--resolution {args.resolution}: want >= 16")
    if args.steps < 1 or args.fps < 1:
        raise ValueError(f"--steps {args.steps} --fps {args.fps}: want both >= 1")
    motion_step(args.resolution, args.frames)


def _cmd_eval_video(args: argparse.Namespace) -> int:
    modes = [m for m in ("clips", "pipeline", "ground_truth", "corrupt") if getattr(args, m)]
    if len(modes) != 1:
        raise ValueError("eval video needs one of --clips DIR, --pipeline DIR, --ground-truth or --corrupt KIND")
    if args.frames is None and not args.clips:
        args.frames = 5
    if args.frames is not None and args.frames < 2:
        raise ValueError(f"--frames {args.frames}: a clip has at least 2 frames")
    rewards = _rewards(args)
    if args.clips:
        if not args.clips.is_dir():
            raise ValueError(f"--clips {args.clips}: no such directory")
        result = _score_clips(args, rewards)
    else:
        _check_sizes(args)
        if rewards and not args.pipeline:
            raise ValueError("--reward scores sampled or given clips: use it with --pipeline or --clips")
        if args.pipeline:
            _check_pipeline(args)
            result = _sample_pipeline(args, rewards)
        elif args.ground_truth:
            from megaflow.shapeeval.video_score import evaluate_video_ground_truth
            result = evaluate_video_ground_truth(args.num, num_frames=args.frames, seed=args.seed,
                                                 resolution=args.resolution, split=args.split)
        else:
            from megaflow.shapeeval.video_score import evaluate_video_corruption
            result = evaluate_video_corruption(args.corrupt, args.num, num_frames=args.frames, seed=args.seed,
                                               resolution=args.resolution)
    if not args.clips:
        result = {k: v for k, v in result.items() if k != "passed"}
    print_json(result, args.json)
    return 0


def _score_clips(args: argparse.Namespace, rewards: dict[str, dict]) -> dict:
    from megaflow.shapeeval.video_score import evaluate_clips
    result, clips, prompts = evaluate_clips(args.clips, num_frames=args.frames)
    if rewards:
        from megaflow.rewards.frames import score_per_frame
        from megaflow.shapeeval.video_evaluate import clips_float
        by_shape: dict[tuple, list[int]] = {}
        for i, c in enumerate(clips):
            by_shape.setdefault(c.shape, []).append(i)
        scored: dict[str, list] = {name: [None] * len(clips) for name in rewards}
        for idx in by_shape.values():
            part = score_per_frame(clips_float([clips[i] for i in idx]), [prompts[i] for i in idx], rewards,
                                 args.reward_frames)
            for name, r in part.items():
                for i, s in zip(idx, r["scores"]):
                    scored[name][i] = s
        result["rewards"] = {name: {"mean": _mean(s), "masked": s.count(None), "scores": s}
                             for name, s in scored.items()}
        result["reward_frames"] = args.reward_frames
    return result


def _mean(scores: list) -> float | None:
    kept = [s for s in scores if s is not None]
    return sum(kept) / len(kept) if kept else None


def _sample_pipeline(args: argparse.Namespace, rewards: dict[str, dict]) -> dict:
    from megaflow.shapeeval.video_evaluate import brief, evaluate_video_pipeline
    out_dir = args.out or Path("runs") / f"{args.pipeline.resolve().name}-video-shapeeval"
    result, clips, prompts = evaluate_video_pipeline(
        args.pipeline, sampler=args.sampler, trust_remote_code=args.trust_remote_code, num=args.num, seed=args.seed,
        num_steps=args.steps, resolution=args.resolution, num_frames=args.frames, fps=args.fps, split=args.split,
        out_dir=out_dir)
    if rewards:
        from megaflow.rewards.frames import score_per_frame
        result["rewards"] = score_per_frame(clips, prompts, rewards, args.reward_frames)
        result["reward_frames"] = args.reward_frames
    (Path(out_dir) / "result.json").write_text(json.dumps(result, sort_keys=True, indent=2) + "\n")
    return brief(result)


def add_video_parser(eval_sub) -> None:
    """``megaflow eval video``."""
    p = eval_sub.add_parser("video", help="Video ShapeEval: score clips (a folder, or sampled from a Wan pipeline), "
                            "or the checker's ceiling on ground-truth clips; optionally image rewards per frame.")
    p.add_argument("--clips", type=Path, default=None, help="Folder of clips (.mp4, .gif, .npy, or folders of PNG "
                   "frames); prompts from manifest.jsonl ({\"file\", \"prompt\"} a line) or the file names.")
    p.add_argument("--pipeline", type=Path, default=None, help="Wan 2.1 diffusers pipeline dir: sample --num prompts "
                   "of --split through the --sampler (ODE, fixed seeds); prints JSON with 95%% intervals and saves "
                   "the clips (PNG frames), their manifest and result.json to --out.")
    p.add_argument("--sampler", choices=SAMPLERS, default=SAMPLERS[0], help="With --pipeline: an SGLang engine, or "
                   "diffusers' own WanPipeline call (an independent check of the engine's figures).")
    p.add_argument("--out", type=Path, default=None,
                   help="Where --pipeline writes its clips (default: runs/<pipeline name>-video-shapeeval).")
    p.add_argument("--ground-truth", action="store_true", help="Render --num ground-truth clips and score them.")
    p.add_argument("--corrupt", default=None, choices=CLIP_CORRUPTIONS,
                   help="Render corrupted clips of held-out prompts and score them against the original prompts.")
    p.add_argument("--num", type=int, default=200, help="Clips for --pipeline / --ground-truth / --corrupt.")
    p.add_argument("--frames", type=int, default=None, help="Frames per clip (default 5; with --clips: any, else "
                   "every clip must have this many).")
    p.add_argument("--split", choices=("eval", "train"), default="eval",
                   help="Prompts of the held-out split (default) or of TRAIN, for --pipeline / --ground-truth.")
    p.add_argument("--steps", type=int, default=10, help="Sampling steps with --pipeline.")
    p.add_argument("--fps", type=int, default=8, help="Frames per second asked of the pipeline.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resolution", type=int, default=32)
    p.add_argument("--reward", action="append", default=[], metavar="NAME", help="Also score the clips by this "
                   "image reward (a built-in name or 'pkg.module:callable'; repeatable), per --reward-frames.")
    p.add_argument("--kwargs", default=None, metavar="JSON", help="The one --reward's keyword arguments (JSON).")
    p.add_argument("--reward-frames", default="mean", metavar="MODE", help="reward.frames' semantics: mean over "
                   "frames, first, a frame index, or video (rewards that take whole clips). Default mean.")
    p.add_argument("--json", action="store_true", help="Print one JSON object.")
    add_trust_remote_code_arg(p)
    p.set_defaults(handler=_cmd_eval_video)
