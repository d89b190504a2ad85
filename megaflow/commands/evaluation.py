"""``megaflow train``'s evaluation (``eval.every``): the ``evaluate(sampler, when)`` hook the loop calls on the
driver ("before", every ``eval.every``-th iteration, "after"); its rows go to the run's eval.jsonl
(megaflow.rundir.eval_log). Design notes: docs/design/commands.md.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from megaflow.config import MegaflowConfig
from megaflow.config.suggest import did_you_mean
from megaflow.report.backends import MAX_IMAGES
from megaflow.report.metrics import Evaluation
from megaflow.rundir.eval_log import iteration_of, record

if TYPE_CHECKING:
    from megaflow.run.loop import Evaluate
GRID_COLUMNS = 8


def eval_hook(cfg: MegaflowConfig, run_dir: Path) -> Evaluate:
    """The ``evaluate(sampler, when)`` hook of ``megaflow train`` for ``cfg`` (``eval.every`` > 0), writing
    into ``run_dir``."""
    if cfg.data.test_prompts:
        return _reward_eval(cfg, Path(run_dir))
    if cfg.data.prompts == "shapes":
        return _shapes_eval(cfg, Path(run_dir))
    raise ValueError("eval.every needs test prompts: data.test_prompts, or data.prompts = 'shapes'")


def settled(cfg: MegaflowConfig, run_dir: Path) -> MegaflowConfig:
    """``cfg`` with the pipeline's defaults (its prompt length), as the loop samples with; called during the
    run, when the pipeline (``model.pretrained`` or the run's tiny one) exists."""
    from megaflow.run.build import resolve_pipeline, with_pipeline_defaults
    return with_pipeline_defaults(cfg, resolve_pipeline(cfg, run_dir))


def grid_path(run_dir: Path, when: str | int, iterations: int) -> Path:
    return Path(run_dir) / "eval" / f"iter{iteration_of(when, iterations):05d}.png"


def _mean(values) -> float | None:
    """Mean of the finite values (a masked image is NaN); None when there is none."""
    kept = [float(v) for v in values if math.isfinite(float(v))]
    return sum(kept) / len(kept) if kept else None


def score_figures(reward, images, prompts: list[str], metadata: list[dict],
                  group_by: list[str] = ()) -> tuple[dict, list[float]]:
    """(``eval/reward_total``, ``eval/<component>`` and ``eval/<field>/<value>`` means, per-image totals) of
    ``images`` under ``reward`` (a :class:`megaflow.rewards.scorer.MultiReward`)."""
    scores = reward.score(images, prompts, metadata)
    totals = [float(v) for v in scores.total.tolist()]
    figures = {"eval/reward_total": _mean(totals)}
    figures.update({f"eval/{label}": _mean(v.tolist()) for label, v in scores.components.items()})
    figures.update(breakdown(totals, metadata, group_by))
    return figures, totals


def breakdown(totals: list[float], metadata: list[dict], group_by: list[str]) -> dict:
    """``eval/<field>/<value>``: the mean of ``totals`` over the samples whose metadata has that value of each
    ``group_by`` field (in the order values first appear)."""
    out = {}
    for field in group_by:
        values: dict[str, list[float]] = {}
        for total, meta in zip(totals, metadata):
            if field in meta:
                values.setdefault(str(meta[field]), []).append(total)
        out.update({f"eval/{field}/{value}": _mean(v) for value, v in values.items()})
    return out


SEED_STRIDE = 100_000  # sample k of prompt i: seed + i + k * SEED_STRIDE (eval.num <= 100_000: no two alike)


def eval_requests(cfg: MegaflowConfig, prompts: list[str], metadata: list[dict]) -> list:
    """One deterministic (ODE) request per prompt of ``eval.samples_per_prompt`` outputs, seeds fixed by
    ``eval.seed``, the prompt and the sample; the rollout's size, prompt length and guidance."""
    from megaflow.families import card
    from megaflow.rollout.types import RolloutRequest
    r, e = cfg.rollout, cfg.eval
    do_cfg = card(cfg.model.family).uses_cfg(r.guidance_scale)
    n = e.samples_per_prompt
    return [RolloutRequest(prompt=p, metadata=m, num_outputs=n, seed=e.seed * 100_003 + i,
                           seeds=[e.seed * 100_003 + i + k * SEED_STRIDE for k in range(n)] if n > 1 else None,
                           num_steps=e.num_steps or r.num_steps, height=r.height, width=r.width,
                           num_frames=r.num_frames or None, fps=r.fps if r.num_frames else None,
                           guidance_scale=r.guidance_scale, do_cfg=do_cfg, sde_type="ode",
                           max_sequence_length=r.max_sequence_length or None, request_id=f"eval{i}")
            for i, (p, m) in enumerate(zip(prompts, metadata))]


def _reward_eval(cfg: MegaflowConfig, run_dir: Path) -> Evaluate:
    from megaflow.data.prompts import prompt_and_metadata, prompt_pool
    pool = prompt_pool(cfg.data.test_prompts, seed=cfg.run.seed, key="data.test_prompts")
    items = [prompt_and_metadata(x) for x in pool[:cfg.eval.num]]
    prompts, metadata = [p for p, _ in items], [m for _, m in items]
    missing = [f for f in cfg.eval.group_by if not any(f in m for m in metadata)]
    if missing:
        raise ValueError(f"eval.group_by: no test prompt of data.test_prompts has the metadata field {missing[0]!r}"
                         f"{did_you_mean(missing[0], {k for m in metadata for k in m})}")
    n = cfg.eval.samples_per_prompt  # the samples of a prompt are consecutive (its request's outputs)
    sample_prompts, sample_meta = [p for p in prompts for _ in range(n)], [m for m in metadata for _ in range(n)]
    state: dict = {}  # the reward and settled config, made at the first evaluation (a model reward loads then)

    def evaluate(sampler, when: str | int):
        import torch

        from megaflow.report.metrics import save_image_grid
        from megaflow.report.video import save_video_grid
        from megaflow.rewards.registry import build_multi_reward
        if not state:
            r = cfg.reward
            state.update(reward=build_multi_reward(r.weights, kwargs=r.kwargs, timeout_s=r.timeout_s,
                                                   frames=r.frames), cfg=settled(cfg, run_dir))
        trajs = sampler.generate(eval_requests(state["cfg"], prompts, metadata))
        images = torch.stack([t.image for t in trajs]).float()
        figures, totals = score_figures(state["reward"], images, sample_prompts, sample_meta, cfg.eval.group_by)
        labels = [f"{t:.3f} {p}" for t, p in zip(totals, sample_prompts)]
        grid = dict(columns=GRID_COLUMNS if n == 1 else n, scale=2, labels=labels)
        if images.dim() == 5:  # clips [N, F, 3, H, W]: an MP4 of grids beside where the PNG would be
            save_video_grid(images, grid_path(run_dir, when, cfg.train.iterations).with_suffix(".mp4"),
                            fps=cfg.rollout.fps, **grid)
        else:
            save_image_grid(images, grid_path(run_dir, when, cfg.train.iterations), **grid)
        row = record(run_dir, when, cfg.train.iterations, {**figures, "eval/num": len(prompts),
                                                            **({"eval/samples": len(totals)} if n > 1 else {})})
        total = figures["eval/reward_total"]
        shown = "masked" if total is None else f"{total:.4f}"
        samples = f" ({n} samples each)" if n > 1 else ""
        print(f"[megaflow] eval {when}: reward {shown} over {len(prompts)} test prompts{samples}", flush=True)
        captions = [f"{p} | reward {t:.3f}" for p, t in zip(sample_prompts, totals)]
        return Evaluation(figures={k: v for k, v in row.items() if k.startswith("eval/")},
                          images=list(images[:MAX_IMAGES]), captions=captions[:MAX_IMAGES])
    return evaluate


def shapes_figures(res: dict) -> dict:
    """The ``eval/*`` figures of a ShapeEval result (:func:`megaflow.shapeeval.evaluate.evaluate_engine`)."""
    figures = {"eval/accuracy": res["accuracy"], "eval/partial_mean": res["partial_mean"], "eval/num": res["num"]}
    if res.get("seen"):
        figures["eval/seen_accuracy"] = res["seen"]["accuracy"]
    figures.update({f"eval/category/{c}": a for c, a in res["per_category"].items()})
    return figures


def shapes_samples(res: dict, limit: int = MAX_IMAGES) -> tuple[list, list[str]]:
    """The first ``limit`` images a ShapeEval result saved (``res["images"]``: NNNN.png and manifest.jsonl) and
    a caption each: its prompt and verdict (pass / fail)."""
    import numpy as np
    import torch
    from PIL import Image

    out_dir = Path(res["images"])
    passed = res["passed"] + res.get("seen", {}).get("passed", [])
    entries = [json.loads(x) for x in (out_dir / "manifest.jsonl").read_text().splitlines()[:limit] if x.strip()]
    images = [torch.from_numpy(np.array(Image.open(out_dir / e["file"]).convert("RGB"))).permute(2, 0, 1)
              .float() / 255 for e in entries]
    captions = [f"{e['prompt']} | {'pass' if ok else 'fail'}" for e, ok in zip(entries, passed)]
    return images, captions


def _shapes_eval(cfg: MegaflowConfig, run_dir: Path) -> Evaluate:
    def evaluate(sampler, when: str | int):
        import shutil

        from megaflow.shapeeval.evaluate import evaluate_engine
        e, r, it = cfg.eval, settled(cfg, run_dir).rollout, iteration_of(when, cfg.train.iterations)
        out_dir = run_dir / "eval" / f"iter{it:05d}"
        res = evaluate_engine(sampler, num=e.num, num_seen=e.num_seen, seed=e.seed,
                              num_steps=e.num_steps or r.num_steps, resolution=r.height, max_sequence_length=r.max_sequence_length or None, out_dir=out_dir)
        shutil.copyfile(out_dir / "grid.png", grid_path(run_dir, when, cfg.train.iterations))
        figures = shapes_figures(res)
        record(run_dir, when, cfg.train.iterations, figures)
        print(f"[megaflow] eval {when}: ShapeEval held-out {res['accuracy']:.3f} (partial {res['partial_mean']:.3f}, "
              f"{res['num']} prompts)", flush=True)
        return Evaluation(figures, *shapes_samples(res))
    return evaluate
