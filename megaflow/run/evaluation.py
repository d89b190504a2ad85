"""``megaflow train``'s evaluation (``eval.every``): the ``evaluate(sampler, when)`` hook that
:func:`megaflow.run.loop.run` calls on the driver before training (``"before"``), after every ``eval.every``-th
iteration (``when`` = the iteration) and after the last (``"after"``), with the engines holding the EMA when the
run has one.

Two kinds, by the config:

- ``data.test_prompts`` set: its first ``eval.num`` prompts, one ODE sample each
  (``eval.num_steps`` or ``rollout.num_steps``, seed ``eval.seed``-derived per prompt, the rollout's size and
  guidance), scored by the run's weighted rewards (``reward.weights``, ``reward.kwargs``, the prompts' metadata):
  ``eval/reward_total`` and ``eval/<component>`` means (over the images a reward did not mask);
- ``data.prompts = "shapes"`` without test prompts: ShapeEval's held-out prompts
  (:func:`megaflow.shapeeval.evaluate.evaluate_engine`, ``eval.num`` / ``eval.num_seen``): ``eval/accuracy``,
  ``eval/partial_mean``, ``eval/seen_accuracy`` and ``eval/category/<name>``.

Each evaluation appends one JSON row ``{"iteration": n, "when": ..., "eval/...": ...}`` to
``<run dir>/eval.jsonl`` (``iteration`` 0 = before training, ``train.iterations`` = after) and saves a captioned
grid ``<run dir>/eval/iterNNNNN.png`` (prompt and score under each image). It is kept apart from
metrics.jsonl, whose rows are one per training iteration (resume and the curves read them so). The hook returns
an ``Evaluation`` (megaflow.report.metrics): the loop hands its figures and its first images, captioned with
prompt and score, to the metrics backends (W&B, TensorBoard) at the iteration's step.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

from megaflow.config import MegaflowConfig
from megaflow.report.backends import MAX_IMAGES
from megaflow.report.metrics import Evaluation

Evaluate = Callable[[object, "str | int"], "Evaluation | None"]
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


def iteration_of(when: str | int, iterations: int) -> int:
    """The iteration an evaluation stands for: 0 before training, ``iterations`` after, else ``when``."""
    if when == "before":
        return 0
    if when == "after":
        return iterations
    return int(when)


def record(run_dir: Path, when: str | int, iterations: int, figures: dict) -> dict:
    """Append ``{"iteration", "when", **figures}`` to ``<run_dir>/eval.jsonl``; the row."""
    row = {"iteration": iteration_of(when, iterations), "when": when, **figures}
    with open(Path(run_dir) / "eval.jsonl", "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row, sort_keys=True) + "\n")
    return row


def grid_path(run_dir: Path, when: str | int, iterations: int) -> Path:
    return Path(run_dir) / "eval" / f"iter{iteration_of(when, iterations):05d}.png"


def _mean(values) -> float | None:
    """Mean of the finite values (a masked image is NaN); None when there is none."""
    kept = [float(v) for v in values if math.isfinite(float(v))]
    return sum(kept) / len(kept) if kept else None


def score_figures(reward, images, prompts: list[str], metadata: list[dict]) -> tuple[dict, list[float]]:
    """(``eval/reward_total`` and ``eval/<component>`` means, per-image totals) of ``images`` under ``reward``
    (a :class:`megaflow.rewards.scorer.MultiReward`)."""
    scores = reward.score(images, prompts, metadata)
    figures = {"eval/reward_total": _mean(scores.total.tolist())}
    figures.update({f"eval/{label}": _mean(v.tolist()) for label, v in scores.components.items()})
    return figures, [float(v) for v in scores.total.tolist()]


def eval_requests(cfg: MegaflowConfig, prompts: list[str], metadata: list[dict]) -> list:
    """One deterministic (ODE) request per prompt, seeds fixed by ``eval.seed``, the rollout's size, prompt
    length and guidance."""
    from megaflow.models.registry import get_family
    from megaflow.rollout.types import RolloutRequest
    r, e = cfg.rollout, cfg.eval
    do_cfg = r.guidance_scale > 1.0 and not get_family(cfg.model.family).embedded_guidance
    return [RolloutRequest(prompt=p, metadata=m, num_outputs=1, seed=e.seed * 100_003 + i,
                           num_steps=e.num_steps or r.num_steps, height=r.height, width=r.width,
                           guidance_scale=r.guidance_scale, do_cfg=do_cfg, sde_type="ode",
                           max_sequence_length=r.max_sequence_length or None, request_id=f"eval{i}")
            for i, (p, m) in enumerate(zip(prompts, metadata))]


def _reward_eval(cfg: MegaflowConfig, run_dir: Path) -> Evaluate:
    from megaflow.data.prompts import prompt_and_metadata, prompt_pool
    pool = prompt_pool(cfg.data.test_prompts, seed=cfg.run.seed, key="data.test_prompts")
    items = [prompt_and_metadata(x) for x in pool[:cfg.eval.num]]
    prompts, metadata = [p for p, _ in items], [m for _, m in items]
    state: dict = {}  # the reward and settled config, made at the first evaluation (a model reward loads then)

    def evaluate(sampler, when: str | int):
        import torch

        from megaflow.report.metrics import save_image_grid
        from megaflow.rewards.registry import build_multi_reward
        if not state:
            r = cfg.reward
            state.update(reward=build_multi_reward(r.weights, kwargs=r.kwargs, timeout_s=r.timeout_s),
                         cfg=settled(cfg, run_dir))
        trajs = sampler.generate(eval_requests(state["cfg"], prompts, metadata))
        images = torch.stack([t.image for t in trajs]).float()
        figures, totals = score_figures(state["reward"], images, prompts, metadata)
        labels = [f"{t:.3f} {p}" for t, p in zip(totals, prompts)]
        save_image_grid(images, grid_path(run_dir, when, cfg.train.iterations), columns=GRID_COLUMNS, scale=2,
                        labels=labels)
        row = record(run_dir, when, cfg.train.iterations, {**figures, "eval/num": len(prompts)})
        total = figures["eval/reward_total"]
        shown = "masked" if total is None else f"{total:.4f}"
        print(f"[megaflow] eval {when}: reward {shown} over {len(prompts)} test prompts", flush=True)
        captions = [f"{p} | reward {t:.3f}" for p, t in zip(prompts, totals)]
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
