"""ShapeEval of a model: sample held-out prompts through an engine, score, report with 95% intervals.
Invariant: the prompt set is fixed by (num, seed) and each prompt has its own seed and ODE sampling, so models
are compared on the same prompts and noise.
"""
from __future__ import annotations

import json
from pathlib import Path


import torch

from megaflow.data.shapes import HELD_OUT_CATEGORIES, SEEN_CATEGORIES, parse_prompt, sample_prompts
from megaflow.shapeeval import SAMPLERS
from megaflow.shapeeval.checker import score_image
from megaflow.shapeeval.score import ci95, summarize, with_intervals  # noqa: F401 (ci95: its old home)


def eval_prompts(num: int, num_seen: int, seed: int, *, split: str = "eval") -> tuple[list[str], list[str]]:
    """(prompts of the held-out categories, seen-category prompts), deterministic in (num, num_seen, seed):
    from the held-out split (``split="eval"``), or from the TRAIN split of the same categories (``"train"``:
    how the model does on prompts it trains on, the same sampler and seeds)."""
    held = sample_prompts(split, num, seed=seed, categories=HELD_OUT_CATEGORIES)
    seen = sample_prompts(split, num_seen, seed=seed, categories=SEEN_CATEGORIES) if num_seen else []
    return held, seen


def requests_for(prompts: list[str], *, seed: int, num_steps: int, resolution: int,
                 max_sequence_length: int | None):
    from megaflow.rollout.types import RolloutRequest
    return [RolloutRequest(prompt=p, num_outputs=1, seed=seed * 100_003 + i, num_steps=num_steps, height=resolution,
                           width=resolution, sde_type="ode", max_sequence_length=max_sequence_length,
                           request_id=f"eval{i}") for i, p in enumerate(prompts)]


def score(images: torch.Tensor, prompts: list[str]) -> dict:
    """ShapeEval summary of float images [N, 3, H, W] in [0, 1], with Wilson 95% intervals."""
    arr = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    verdicts = [score_image(im, parse_prompt(p)) for im, p in zip(arr, prompts)]
    out = with_intervals(summarize(verdicts))
    out["passed"] = [bool(v.passed) for v in verdicts]
    return out


def save_images(images: torch.Tensor, prompts: list[str], out_dir: Path, *, columns: int = 10,
                passed: list[bool] | None = None) -> None:
    """PNG per image + manifest.jsonl + ``grid.png``: the first ``columns`` images of each category, a row per
    category, enlarged 4x with each prompt written under its image (``passed``: a pass/fail mark before it),
    and ``grid.txt``, the same prompts by row and column."""
    from PIL import Image

    from megaflow.data.shapes import category_of
    from megaflow.report.metrics import save_image_grid
    out_dir.mkdir(parents=True, exist_ok=True)
    arr = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    rows, by_cat = [], {}
    for i, (im, p) in enumerate(zip(arr, prompts)):
        name = f"{i:04d}.png"
        Image.fromarray(im).save(out_dir / name)
        rows.append(json.dumps({"file": name, "prompt": p}))
        by_cat.setdefault(category_of(parse_prompt(p)), []).append(i)
    (out_dir / "manifest.jsonl").write_text("\n".join(rows) + "\n")
    cells, labels, legend = [], [], []
    blank = torch.ones_like(images[0])
    for idx in by_cat.values():
        row = idx[:columns]
        mark = (lambda i: ("ok " if passed[i] else "x ")) if passed is not None else (lambda i: "")
        cells += [images[i] for i in row] + [blank] * (columns - len(row))
        labels += [mark(i) + prompts[i] for i in row] + [""] * (columns - len(row))
        legend.append(" | ".join(mark(i) + prompts[i] for i in row))
    save_image_grid(torch.stack(cells), out_dir / "grid.png", columns=columns, scale=4, labels=labels)
    (out_dir / "grid.txt").write_text("".join(f"row {r}: {line}\n" for r, line in enumerate(legend)))


def evaluate_engine(engine, *, num: int = 300, num_seen: int = 60, seed: int = 0, num_steps: int = 10,
                    resolution: int = 32, max_sequence_length: int | None = None, out_dir: Path | None = None,
                    split: str = "eval") -> dict:
    """Sample the fixed prompt set (``eval_prompts``) through ``engine`` (ODE), score it; JSON-able result."""
    held, seen = eval_prompts(num, num_seen, seed, split=split)
    prompts = held + seen
    trajs = engine.generate(requests_for(prompts, seed=seed, num_steps=num_steps, resolution=resolution,
                                         max_sequence_length=max_sequence_length))
    images = torch.stack([t.image for t in trajs])
    result = score(images[:len(held)], held)
    result["seen"] = score(images[len(held):], seen) if seen else {}
    result.update(seed=seed, num_steps=num_steps, resolution=resolution, split=split)
    if out_dir is not None:
        save_images(images, prompts, Path(out_dir), passed=result["passed"] + result["seen"].get("passed", []))
        result["images"] = str(out_dir)
    return result


def evaluate_pipeline(pipeline_dir: Path, *, num: int = 300, num_seen: int = 60, seed: int = 0, num_steps: int = 10,
                      resolution: int = 32, out_dir: Path | None = None, sampler: str = "sglang",
                      trust_remote_code: bool = False) -> dict:
    """Evaluate ``pipeline_dir`` (``evaluate_engine``) through one SGLang engine (``sampler="sglang"``) or
    diffusers' own pipeline call (``"diffusers"``, megaflow.rollout.pipeline_sampler: an independent sampler);
    either refuses a directory that names code unless ``trust_remote_code``."""
    from megaflow.models.pipeline_meta import declared_text_len
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler {sampler!r}: expected one of {', '.join(SAMPLERS)}")
    pipeline_dir = Path(pipeline_dir)
    if not (pipeline_dir / "model_index.json").is_file():
        raise ValueError(f"--pipeline {pipeline_dir}: not a diffusers pipeline directory (no model_index.json)")
    if sampler == "diffusers":
        from megaflow.rollout.pipeline_sampler import PipelineSampler
        engine = PipelineSampler.from_pretrained(str(pipeline_dir), trust_remote_code=trust_remote_code)
    else:
        from megaflow.config.model_family import pipeline_family
        from megaflow.rollout.sglang import SGLangEngine, SGLangEngineConfig
        family = pipeline_family(pipeline_dir)  # the engine runs the family's own SGLang pipeline
        engine = SGLangEngine(SGLangEngineConfig(model_path=str(pipeline_dir), trust_remote_code=trust_remote_code,
                                                 **({"family": family} if family else {})))
    try:
        result = evaluate_engine(engine, num=num, num_seen=num_seen, seed=seed, num_steps=num_steps,
                                 resolution=resolution, max_sequence_length=declared_text_len(pipeline_dir),
                                 out_dir=out_dir)
        return {**result, "sampler": sampler}
    finally:
        engine.shutdown()


def brief(result: dict) -> dict:
    """The result without per-image lists (for printing)."""
    out = {k: v for k, v in result.items() if k != "passed"}
    for part in ("seen", "train"):
        if result.get(part):
            out[part] = brief(result[part])
    return out



