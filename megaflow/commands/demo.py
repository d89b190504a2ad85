"""``megaflow demo``: held-out ShapeEval before -> FlowGRPO on TRAIN prompts -> held-out ShapeEval after.

Writes ``<run dir>/summary.json`` and the before/after images (``eval_before/``, ``eval_after/``) and ends with one
line: ``ShapeEval (held-out, 300 prompts): 0.42 -> 0.71 in 13m20s``.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from megaflow.config import MegaflowConfig


class PeakRSS:
    """Peak resident memory of this process and all its children (engine workers), sampled."""

    def __init__(self, interval_s: float = 0.5):
        import psutil
        self._proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        import psutil
        while not self._stop.is_set():
            total = 0
            for p in [self._proc, *self._proc.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(interval_s)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 2**30


def _summary(cfg: MegaflowConfig, run_dir: Path, before: dict, after: dict, metrics: dict, *, wall: float,
             peak_rss_gb: float) -> dict:
    """summary.json: ShapeEval before and after, the run's shape and cost, the first and last batch reward (from
    ``run_dir``'s metrics)."""
    from megaflow.report.progress import previous_rows
    from megaflow.shapeeval.evaluate import brief

    rows = [r for r in previous_rows(run_dir / "metrics.jsonl", cfg.train.iterations) if "reward/total" in r]
    r, e = cfg.rollout, cfg.eval
    return {
        "shapeeval_before": before["accuracy"], "shapeeval_after": after["accuracy"],
        "ci95_before": before["ci95"], "ci95_after": after["ci95"],
        "per_category_before": before["per_category"], "per_category_after": after["per_category"],
        "seen_before": before["seen"].get("per_category", {}), "seen_after": after["seen"].get("per_category", {}),
        "partial_before": before["partial_mean"], "partial_after": after["partial_mean"],
        "num_eval_prompts": before["num"], "wall_s": wall, "peak_rss_gb": peak_rss_gb,
        **_train_prompt_summary(before, after),
        "algorithm": cfg.algo.name, "ema_decay": cfg.train.ema_decay,
        "evaluated_weights": "ema" if cfg.train.ema_decay > 0 else "trained",
        "iterations": cfg.train.iterations,
        "launch": {"world_size": int(os.environ.get("WORLD_SIZE", "1")), "placement": r.placement,
                   "engine_ranks": r.engine_ranks, "engine_hosts": r.engine_hosts, "bridge": cfg.bridge.mode},
        "images_sampled": cfg.train.iterations * r.prompts_per_iter * r.group_size
        + 2 * (e.num + e.num_seen + e.num_train),
        "reward_first": rows[0]["reward/total"] if rows else None, "reward_last": rows[-1]["reward/total"] if rows else None,
        "eval_before": brief(before), "eval_after": brief(after), "last_metrics": metrics,
    }


def run_demo(cfg: MegaflowConfig, *, verbose: bool = False) -> dict:
    """The demo; ``verbose``: engine logs on the terminal (see ``megaflow.run.loop.run``)."""
    from megaflow.run.build import with_pipeline_defaults
    from megaflow.run.loop import run
    from megaflow.rundir.claim import with_unused_name
    from megaflow.shapeeval.evaluate import evaluate_engine

    t0 = time.perf_counter()
    rss = PeakRSS()
    cfg = with_pipeline_defaults(cfg, Path(cfg.model.pretrained))
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # a launch's ranks must agree: there the name is as given
        cfg = with_unused_name(cfg)
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    results: dict[str, dict] = {}
    e = cfg.eval

    def evaluate(rollout, when: str | int):
        common = dict(seed=e.seed, num_steps=e.num_steps or cfg.rollout.num_steps, resolution=cfg.rollout.height,
                      max_sequence_length=cfg.rollout.max_sequence_length or None)
        res = evaluate_engine(rollout, num=e.num, num_seen=e.num_seen, out_dir=run_dir / f"eval_{when}", **common)
        if e.num_train:
            res["train"] = evaluate_engine(rollout, num=e.num_train, num_seen=0, split="train",
                                           out_dir=run_dir / f"eval_{when}_train", **common)
        results[when] = res
        lo, hi = res["ci95"]
        train = f"; train prompts {res['train']['accuracy']:.3f}" if e.num_train else ""
        print(f"[megaflow] ShapeEval {when}: held-out {res['accuracy']:.3f} (95% CI {lo:.3f}-{hi:.3f}, "
              f"{res['num']} prompts); seen categories {res['seen'].get('accuracy', float('nan')):.3f}{train}",
              flush=True)
        return demo_evaluation(res)

    metrics = run(cfg, evaluate=evaluate, verbose=verbose)
    wall = time.perf_counter() - t0
    if not results:  # not the driver: evaluation and the summary are rank 0's
        rss.stop()
        return {}
    before, after = results["before"], results["after"]
    summary = _summary(cfg, run_dir, before, after, metrics, wall=wall, peak_rss_gb=rss.stop())
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True, default=float))
    m, s = divmod(int(round(wall)), 60)
    print(f"ShapeEval (held-out, {before['num']} prompts): {before['accuracy']:.2f} -> {after['accuracy']:.2f} "
          f"in {m}m{s:02d}s   (summary: {run_dir / 'summary.json'})", flush=True)
    return summary


def demo_evaluation(res: dict):
    """A ShapeEval result of the demo as the reporter takes it: ``eval/*`` figures (``eval/train_accuracy``:
    the TRAIN prompts' accuracy, when evaluated) and the first held-out images with prompt and verdict."""
    from megaflow.report.metrics import Evaluation
    from megaflow.commands.evaluation import shapes_figures, shapes_samples
    figures = shapes_figures(res)
    if "train" in res:
        figures["eval/train_accuracy"] = res["train"]["accuracy"]
    return Evaluation(figures, *shapes_samples(res))


def _train_prompt_summary(before: dict, after: dict) -> dict:
    """TRAIN-prompt accuracy before/after (same sampler and seeds as the held-out number), when evaluated."""
    if "train" not in before:
        return {}
    b, a = before["train"], after["train"]
    return {"train_prompts_before": b["accuracy"], "train_prompts_after": a["accuracy"],
            "train_prompts_ci95_before": b["ci95"], "train_prompts_ci95_after": a["ci95"],
            "train_prompts_per_category_before": b["per_category"], "train_prompts_per_category_after": a["per_category"],
            "num_train_prompts": b["num"]}
