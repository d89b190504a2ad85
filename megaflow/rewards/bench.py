"""Reward timing benchmark: median wall time per batch for every registered reward, and the
ShapeEval checker's accuracies. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megaflow.shapeeval.render import CORRUPTIONS, render_prompts
from megaflow.data.shapes import sample_prompts
from megaflow.shapeeval.score import evaluate_corruption, evaluate_ground_truth
from megaflow.config.preflight import SERVER_REWARDS
from megaflow.config.reward_files import MODEL_REWARDS
from megaflow.rewards.registry import REWARDS, build_reward

_KWARGS = {"cifar10": {"target": "ship"}, "color_target": {"target": "red"}}  # prompts name neither


def time_rewards(batch: int, resolution: int, repeats: int) -> dict[str, float]:
    """Median milliseconds per batch of ``batch`` ShapeEval ground-truth images, per reward."""
    prompts = sample_prompts("eval", batch, seed=0)
    x = torch.from_numpy(render_prompts(prompts, resolution=resolution, seed=0)).permute(0, 3, 1, 2).float() / 255
    out = {}
    for name in REWARDS:
        if name in SERVER_REWARDS:  # scored by a server elsewhere: its time is the server's
            continue
        if name in MODEL_REWARDS:  # read models from a directory the user downloads (none here)
            continue
        reward = build_reward(name, **_KWARGS.get(name, {}))
        reward(x, prompts)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            reward(x, prompts)
            times.append(time.perf_counter() - t0)
        out[name] = round(1000 * statistics.median(times), 3)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--resolutions", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--num-eval", type=int, default=200, help="ShapeEval prompts per accuracy figure")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result: dict = {"batch": args.batch, "threads": torch.get_num_threads(), "ms_per_batch": {}, "shapeeval": {}}
    for res in args.resolutions:
        result["ms_per_batch"][str(res)] = time_rewards(args.batch, res, args.repeats)
        t0 = time.perf_counter()
        gt = evaluate_ground_truth(args.num_eval, seed=0, resolution=res)
        entry = {"ground_truth": {k: gt[k] for k in ("accuracy", "partial_mean", "per_category")},
                 "render_and_check_ms_per_image": round(1000 * (time.perf_counter() - t0) / args.num_eval, 3)}
        for kind in CORRUPTIONS:
            c = evaluate_corruption(kind, args.num_eval, seed=0, resolution=res)
            entry[f"corrupt_{kind}"] = {"accuracy": c["accuracy"], "partial_mean": round(c["partial_mean"], 4)}
        result["shapeeval"][str(res)] = entry
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
