"""Copy a pretrained ShapeEval pipeline into the repo with its recipe (RECIPE.md: commands, seeds, wall time,
pretraining curve, held-out ShapeEval through the SGLang engine, sha256 of every file).

    python tools/ship_pretrained.py --pipeline runs/shapes_pretrain_stage2/pipeline --out assets/shapeeval-sd3 \
        --eval runs/ship-eval.json --commands "megaflow pretrain ..." "megaflow pretrain ..."

``--eval`` is the JSON printed by ``megaflow eval shapes --pipeline DIR --num 300``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import textwrap
from pathlib import Path


def _history(meta: dict) -> list[dict]:
    """Evaluation rows of every stage, oldest first (a continued run keeps its predecessor's under 'previous')."""
    stages, node = [], meta
    while node:
        stages.append(node.get("history", []))
        node = node.get("parts", {}).get("previous", {})
    rows, offset = [], 0.0
    for k, hist in enumerate(reversed(stages)):
        for r in hist:
            rows.append({**r, "stage": k + 1, "total_minutes": offset + r["minutes"]})
        offset += hist[-1]["minutes"] if hist else 0.0
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--eval", type=Path, required=True, help="JSON of `megaflow eval shapes --pipeline`")
    ap.add_argument("--commands", nargs="+", required=True, help="the commands that made the pipeline, in order")
    args = ap.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    shutil.copytree(args.pipeline, args.out)
    from megaflow.config.model_family import pipeline_family
    from megaflow.models.pipeline_meta import read_meta
    from megaflow.pretrain.kit import family_kit
    meta = read_meta(args.out)
    kit = family_kit(pipeline_family(args.out))
    rows = _history(meta["pretrain"])
    ev = json.loads(args.eval.read_text())
    from megaflow.report.plots import line_plot
    line_plot({"held-out accuracy (EMA, 100 prompts)": [(r["total_minutes"], r["accuracy"]) for r in rows],
               "held-out partial score": [(r["total_minutes"], r["partial"]) for r in rows]},
              args.out / "pretrain_curve.png", title="megaflow pretrain: held-out ShapeEval", xlabel="minutes")
    layers = meta["pretrain"].get("config", {}).get("num_layers", "?")
    lines = [f"# {args.out.name}: the pretrained ShapeEval model", "",
             *textwrap.wrap(kit.DESCRIPTION.format(num_layers=layers), 116, break_on_hyphens=False), "", "## Commands (in order)", ""]
    lines += [f"    {c}" for c in args.commands]
    lines += ["", "## Pretraining curve (held-out, EMA weights, 100 prompts, 10 ODE steps)", "",
              "| stage | step | minutes (total) | loss | accuracy | partial | per category |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        cats = ", ".join(f"{k} {v:.2f}" for k, v in r["per_category"].items())
        lines.append(f"| {r['stage']} | {r['step']} | {r['total_minutes']:.1f} | {r['loss']:.4f} | {r['accuracy']:.3f} | "
                     f"{r['partial']:.3f} | {cats} |")
    lo, hi = ev["ci95"]
    lines += ["", f"## Held-out ShapeEval through the SGLang engine ({ev['num']} prompts, seed {ev['seed']}, "
              f"{ev['num_steps']} ODE steps)", "",
              f"accuracy **{ev['accuracy']:.3f}** (95% CI {lo:.3f}-{hi:.3f}), partial {ev['partial_mean']:.3f}", "",
              "| category | accuracy | n |", "|---|---|---|"]
    lines += [f"| {c} | {a:.3f} | {ev['per_category_num'][c]} |" for c, a in ev["per_category"].items()]
    seen = ev.get("seen") or {}
    lines += [f"| {c} (seen in training) | {a:.3f} | {seen['per_category_num'][c]} |"
              for c, a in seen.get("per_category", {}).items()]
    lines += ["", "## sha256", ""]
    for path in sorted(p for p in args.out.rglob("*") if p.is_file() and p.name != "RECIPE.md"):
        lines.append(f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.relative_to(args.out)}")
    (args.out / "RECIPE.md").write_text("\n".join(lines) + "\n")
    print(f"shipped {args.out} ({sum(p.stat().st_size for p in args.out.rglob('*') if p.is_file()) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
