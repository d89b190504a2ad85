"""``megaflow bench learn --algos``: the algorithms side by side, each its recipe (``ALGO_CONFIGS``) in a
process of its own; JSON, a markdown table and a plot. Invariant: every algorithm is scored on the same prompts
and seeds (checked equal before any run).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from megaflow.config import MegaflowConfig, load_config
from megaflow.config.preflight import preflight

ALGO_CONFIGS = {"flowgrpo": "shapes_demo_flowgrpo.toml", "nft": "shapes_demo.toml", "awm": "shapes_demo_awm.toml",
                "dgpo": "shapes_demo_dgpo.toml"}
"""Algorithm -> its recipe, a file of the repository's configs/ (the NFT demo is shapes_demo.toml)."""
GAINS = (0.1, 0.2)
"""Held-out gains whose RL time the table reports (from each algorithm's fixed-prompt curve)."""


def recipes(algos: list[str], config_dir: Path, overrides: list[str]) -> dict[str, MegaflowConfig]:
    """Each algorithm's config (with ``overrides``); a ValueError names an unknown algorithm or a config whose
    evaluation, model or prompts differ from the first one's."""
    unknown = [a for a in algos if a not in ALGO_CONFIGS]
    if unknown or not algos:
        raise ValueError(f"--algos: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(ALGO_CONFIGS)}")
    cfgs = {a: preflight(load_config(config_dir / ALGO_CONFIGS[a], overrides), "train") for a in algos}
    first, ref = algos[0], cfgs[algos[0]]
    for a, c in cfgs.items():
        if c.algo.name != a:
            raise ValueError(f"{ALGO_CONFIGS[a]}: algo.name is {c.algo.name!r}, not {a!r}")
        for what, got, want in (("eval", c.eval, ref.eval), ("model.pretrained", c.model.pretrained,
                                ref.model.pretrained), ("data.prompts", c.data.prompts, ref.data.prompts)):
            if got != want:
                raise ValueError(f"--algos: {a}'s {what} differs from {first}'s ({got!r} vs {want!r}): the "
                                 "leaderboard compares on one model, prompt set and evaluation")
    return cfgs


def reused_reports(reuse: list[str], cfgs: dict[str, MegaflowConfig], out_dir: Path, *, eval_every: int,
                   eval_num: int) -> dict[str, dict]:
    """The earlier reports ``<out_dir>/<algo>.json`` of the algorithms in ``reuse``; a ValueError of one line
    names a missing report, or a recipe or evaluation field it recorded that today's config gives otherwise."""
    from megaflow.bench.learn import eval_record, recipe_record
    from megaflow.bench.learn_report import checked_side, read_report

    reports = {}
    for algo in reuse:
        if algo not in cfgs:
            raise ValueError(f"--reuse {algo}: not one of --algos ({', '.join(cfgs)})")
        path = out_dir / f"{algo}.json"
        report = read_report(path, f"--reuse {algo}")
        side = checked_side(report, "megaflow", path, f"--reuse {algo}")
        now = {"recipe": recipe_record(cfgs[algo]), "eval": eval_record(cfgs[algo], eval_every, eval_num)}
        for part, fields in now.items():
            differing = _first_difference(report.get(part, {}), fields)
            if differing:
                name, was, today = differing
                raise ValueError(f"--reuse {algo}: {path} ran {part} {name} = {was!r}, {ALGO_CONFIGS[algo]} with "
                                 f"these options gives {today!r}: run it again")
        reports[algo] = side
    return reports


def _first_difference(recorded: dict, today: dict) -> tuple[str, object, object] | None:
    """The first (dotted name, recorded value, today's value) that differs, over the top-level fields both hold
    (an older report records fewer); a leaf missing on one side reads "(absent)"."""
    for key in sorted(set(recorded) & set(today)):
        was, now = dict(_flat(recorded[key], key)), dict(_flat(today[key], key))
        for name in sorted(set(was) | set(now)):
            pair = (was.get(name, "(absent)"), now.get(name, "(absent)"))
            if pair[0] != pair[1]:
                return (name, *pair)
    return None


def _flat(value, name: str):
    """(dotted name, leaf value) pairs of a JSON value."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _flat(inner, f"{name}.{key}")
    else:
        yield name, value


def run_one(algo: str, config: Path, overrides: list[str], out: Path, *, eval_every: int, eval_num: int) -> dict:
    """``megaflow bench learn --side megaflow`` for one algorithm in its own process; its JSON report."""
    cmd = [sys.executable, "-m", "megaflow.cli", "bench", "learn", "--side", "megaflow", "-c", str(config),
           "--eval-every", str(eval_every), "--eval-num", str(eval_num), "--out", str(out),
           *(x for s in overrides for x in ("--set", s))]
    proc = subprocess.run(cmd, stdout=sys.stderr)  # its progress lines; this process prints the JSON
    if proc.returncode != 0:
        raise RuntimeError(f"bench learn for {algo} exited {proc.returncode} (command: {' '.join(cmd)})")
    return json.loads(out.read_text())


def entry(cfg: MegaflowConfig, side: dict) -> dict:
    """One algorithm's row: held-out and train-prompt accuracy before -> after (95% intervals), per category,
    RL time to each of ``GAINS`` (None: not reached), images sampled, RL minutes, peak memory."""
    from megaflow.bench.learn import time_to_gain

    b, a = side["before"], side["after"]
    r = cfg.rollout
    return {"held_out": {"before": b["accuracy"], "after": a["accuracy"], "before_ci95": b["ci95"],
                         "after_ci95": a["ci95"], "gain": a["accuracy"] - b["accuracy"]},
            "seen_prompts": {"before": b["seen_accuracy"], "after": a["seen_accuracy"]},
            "per_category_after": a["per_category"],
            "time_to_gain_s": {f"+{g:g}": time_to_gain(side["curve"], g) if side["curve"] else None for g in GAINS},
            "images_sampled": cfg.train.iterations * r.prompts_per_iter * r.group_size,
            "iterations": cfg.train.iterations, "rl_minutes": side["rl_wall_s"] / 60,
            "peak_rss_mib": side.get("peak_rss_mib"), "curve": side["curve"]}


def table(rows: dict[str, dict]) -> str:
    """The leaderboard as a markdown table, best held-out after first."""
    def pct(x):
        return "-" if x is None else f"{x:.2f}"

    def ci(c):
        return f"[{c[0]:.2f}, {c[1]:.2f}]"

    def minutes(s):
        return "-" if s is None else f"{s / 60:.1f}"

    head = ("| algorithm | held-out before -> after (95% CI after) | gain | seen-category prompts before -> after | "
            + " | ".join(f"min to +{g:g}" for g in GAINS) + " | RL min | images | peak RSS MiB |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for algo, e in sorted(rows.items(), key=lambda kv: -kv[1]["held_out"]["after"]):
        h, t, rss = e["held_out"], e["seen_prompts"], e["peak_rss_mib"] or {}
        lines.append(f"| {algo} | {h['before']:.2f} -> {h['after']:.2f} {ci(h['after_ci95'])} | {h['gain']:+.2f} | "
                     f"{pct(t['before'])} -> {pct(t['after'])} | "
                     + " | ".join(minutes(e["time_to_gain_s"][f"+{g:g}"]) for g in GAINS)
                     + f" | {e['rl_minutes']:.1f} | {e['images_sampled']} | {sum(rss.values()) or '-'} |")
    return "\n".join(lines)


def leaderboard(algos: list[str], *, config_dir: Path, overrides: list[str], out_dir: Path, eval_every: int,
                eval_num: int, reuse: list[str] = ()) -> dict:
    """Run every algorithm of ``algos`` in turn (those in ``reuse``: read their earlier report from ``out_dir``);
    write ``<out_dir>/<algo>.json``, ``leaderboard.md`` and ``leaderboard.png``; return the report."""
    from megaflow.report.plots import line_plot

    cfgs = recipes(algos, config_dir, overrides)  # every config and reused report checked before the first run
    reused = reused_reports(list(reuse), cfgs, out_dir, eval_every=eval_every, eval_num=eval_num)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = {}
    for algo in algos:
        if algo in reused:
            side = reused[algo]
        else:
            side = run_one(algo, config_dir / ALGO_CONFIGS[algo], overrides, out_dir / f"{algo}.json",
                           eval_every=eval_every, eval_num=eval_num)["sides"]["megaflow"]
        rows[algo] = entry(cfgs[algo], side)
    (out_dir / "leaderboard.md").write_text(table(rows) + "\n")
    series = {a: [(p["rl_s"] / 60, p["accuracy"]) for p in e["curve"]] for a, e in rows.items() if e["curve"]}
    if series:
        line_plot(series, out_dir / "leaderboard.png", title=f"held-out ShapeEval ({eval_num} prompts) vs RL time",
                  xlabel="RL minutes")
    first = cfgs[algos[0]]
    return {"algorithms": rows, "eval": {"num": first.eval.num, "num_seen": first.eval.num_seen,
                                         "seed": first.eval.seed, "eval_every": eval_every, "eval_num": eval_num},
            "overrides": overrides, "configs": {a: ALGO_CONFIGS[a] for a in algos}, "reused": sorted(reused),
            "table": str(out_dir / "leaderboard.md"), "plot": str(out_dir / "leaderboard.png") if series else None}
