"""``megaflow bench learn``: the demo's RL recipe through a plain single-process loop vs megaflow, from the same
pipeline, prompts, seeds, reward and plans. Design notes: docs/design/bench.md.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from megaflow.config import MegaflowConfig

SIDES = ("baseline", "megaflow")


# ------------------------------------------------------------------ evaluations and the RL clock
def _brief(res: dict) -> dict:
    return {"accuracy": res["accuracy"], "ci95": res["ci95"], "partial_mean": res["partial_mean"], "num": res["num"],
            "per_category": res["per_category"], "seen_accuracy": (res.get("seen") or {}).get("accuracy")}


class _Tracker:
    """Held-out evals (full before/after, small ones every ``eval_every`` iterations) and the RL clock,
    which excludes evaluation time."""

    def __init__(self, cfg: MegaflowConfig, run_dir: Path, *, eval_every: int, eval_num: int):
        self.cfg, self.run_dir, self.eval_every, self.eval_num = cfg, run_dir, eval_every, eval_num
        self.full, self.curve, self.rewards = {}, [], []
        self._t0, self._eval_s, self.rl_s = 0.0, 0.0, 0.0

    def _eval(self, engine, num: int, num_seen: int, out_dir=None) -> dict:
        from megaflow.shapeeval.evaluate import evaluate_engine
        e, r = self.cfg.eval, self.cfg.rollout
        return evaluate_engine(engine, num=num, num_seen=num_seen, seed=e.seed, num_steps=e.num_steps or r.num_steps,
                               resolution=r.height, max_sequence_length=r.max_sequence_length or None, out_dir=out_dir)

    def _elapsed(self) -> float:
        return time.perf_counter() - self._t0 - self._eval_s

    def _point(self, engine, k: int) -> None:
        t, t1 = self._elapsed(), time.perf_counter()
        res = self._eval(engine, self.eval_num, 0)
        self._eval_s += time.perf_counter() - t1
        self.curve.append({"iteration": k, "rl_s": t, "accuracy": res["accuracy"], "partial_mean": res["partial_mean"]})
        print(f"[bench learn] {self.run_dir.name} iteration {k}: held-out ({self.eval_num}) {res['accuracy']:.3f} "
              f"at {t:.0f} s of RL", flush=True)

    def before(self, engine) -> None:
        e = self.cfg.eval
        self.full["before"] = self._eval(engine, e.num, e.num_seen, self.run_dir / "eval_before")
        self._t0, self._eval_s = time.perf_counter(), 0.0
        if self.eval_every:
            self._point(engine, 0)

    def checkpoint(self, engine, k: int) -> None:
        """After iteration ``k``: a small eval when due (the last iteration's comes with ``after``)."""
        if self.eval_every and 0 < k < self.cfg.train.iterations and k % self.eval_every == 0:
            self._point(engine, k)

    def after(self, engine) -> None:
        self.rl_s = self._elapsed()
        if self.eval_every:
            self._point(engine, self.cfg.train.iterations)
        e = self.cfg.eval
        self.full["after"] = self._eval(engine, e.num, e.num_seen, self.run_dir / "eval_after")

    def summary(self, target_gain: float) -> dict:
        before, after = self.full["before"], self.full["after"]
        n = self.cfg.train.iterations
        return {"before": _brief(before), "after": _brief(after), "gain": after["accuracy"] - before["accuracy"],
                "reward_per_iteration": self.rewards, "rl_wall_s": self.rl_s, "s_per_iteration": self.rl_s / n,
                "eval_s": self._eval_s, "curve": self.curve,
                "time_to_target_gain_s": time_to_gain(self.curve, target_gain) if self.curve else
                (self.rl_s if after["accuracy"] - before["accuracy"] >= target_gain else None)}


def time_to_gain(curve: list[dict], gain: float) -> float | None:
    """RL seconds at which a curve first reached ``accuracy − accuracy at iteration 0 >= gain``."""
    return next((p["rl_s"] for p in curve if p["accuracy"] - curve[0]["accuracy"] >= gain - 1e-12), None)


# ------------------------------------------------------------------ the two sides
def run_baseline(cfg: MegaflowConfig, *, eval_every: int = 0, eval_num: int = 100, target_gain: float = 0.05) -> dict:
    """The plain loop (megaflow.bench.plain: ``algo.name``'s update in plain torch); returns the side's summary
    plus setup_s and param_delta_l2."""
    from megaflow.bench.plain import plain_algorithm
    from megaflow.rollout.baseline import DiffusersEngine, DiffusersEngineConfig
    from megaflow.run.build import build_scorer, prompt_stream, resolve_pipeline, with_pipeline_defaults
    from megaflow.run.requests import generate_and_score

    t0 = time.perf_counter()
    torch.set_num_threads(cfg.run.num_threads)
    torch.manual_seed(cfg.run.seed)
    run_dir = Path(cfg.run.output_dir) / f"{cfg.run.name}-learn-baseline"
    pipeline_dir = resolve_pipeline(cfg, run_dir)
    cfg = with_pipeline_defaults(cfg, pipeline_dir)
    if cfg.algo.mismatch != "none":
        raise ValueError("bench learn: the plain loop samples with the trained module itself; use algo.mismatch = none")
    engine = DiffusersEngine.from_pretrained(str(pipeline_dir), config=DiffusersEngineConfig(engine_id="baseline"))
    algorithm = plain_algorithm(cfg, engine)
    initial = {k: v.detach().clone() for k, v in algorithm.dit.named_parameters()}
    scorer, prompts = build_scorer(cfg), prompt_stream(cfg)
    tracker = _Tracker(cfg, run_dir, eval_every=eval_every, eval_num=eval_num)
    setup_s = time.perf_counter() - t0
    try:
        tracker.before(engine)
        for it in range(1, cfg.train.iterations + 1):
            t1 = time.perf_counter()
            trajs, adv, keep, metrics = generate_and_score(engine, scorer, algorithm.requests(prompts, it), cfg)
            tracker.rewards.append(metrics["reward/total"])
            stats = algorithm.update(trajs, adv, keep, it)
            print(f"[bench learn] baseline iteration {it}/{cfg.train.iterations}: reward {metrics['reward/total']:.4f} "
                  f"loss {stats.get('loss', float('nan')):.4g} ({time.perf_counter() - t1:.1f} s)", flush=True)
            with algorithm.evaluated():
                tracker.checkpoint(engine, it)
        with algorithm.evaluated():
            tracker.after(engine)
    finally:
        scorer.close()
        engine.shutdown()
    delta = sum(float((p.detach() - initial[k]).double().pow(2).sum())
                for k, p in algorithm.dit.named_parameters()) ** 0.5
    return {**tracker.summary(target_gain), "setup_s": setup_s, "param_delta_l2": delta}


def run_megaflow(cfg: MegaflowConfig, *, eval_every: int = 0, eval_num: int = 100, target_gain: float = 0.05) -> dict:
    """``megaflow.run.loop.run`` with evaluation hooks (intermediate evals run before the next iteration's
    rollouts)."""
    from megaflow.run.build import resolve_pipeline, with_pipeline_defaults
    from megaflow.run.loop import run
    from megaflow.rundir.claim import with_unused_name

    t0 = time.perf_counter()
    cfg = with_unused_name(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run,
                                                                            name=f"{cfg.run.name}-learn-megaflow")))
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    tracker = _Tracker(with_pipeline_defaults(cfg, resolve_pipeline(cfg, run_dir)), run_dir,
                       eval_every=eval_every, eval_num=eval_num)
    setup = {}

    def evaluate(rollout, when: str | int) -> None:
        if when == "before":
            setup["s"] = time.perf_counter() - t0
            tracker.before(rollout)
        elif when == "after":
            tracker.after(rollout)
        else:
            tracker.checkpoint(rollout, when)

    run(cfg, evaluate=evaluate, evaluate_every=eval_every)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    tracker.rewards = [r["reward/total"] for r in rows if r.get("iteration", 0) > 0 and "reward/total" in r]
    return {**tracker.summary(target_gain), "setup_s": setup.get("s"), "peak_rss_mib": peak_rss_mib()}


def peak_rss_mib() -> dict:
    """Peak resident memory of this process (the trainer) and of its finished children (the engine workers: the
    largest one), MiB."""
    import resource

    return {"trainer": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
            "engine_workers": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024}


def recipe_record(cfg: MegaflowConfig) -> dict:
    """What a report records of the recipe it ran (JSON values): the main knobs, and the whole ``[algo]``,
    ``[train]`` and ``[rollout]`` tables."""
    r, t = cfg.rollout, cfg.train
    record = {"pipeline": cfg.model.pretrained or "(tiny, made for the run)", "iterations": t.iterations,
              "prompts_per_iter": r.prompts_per_iter, "group_size": r.group_size, "num_steps": r.num_steps,
              "sde_type": r.sde_type, "noise_level": r.noise_level, "lr": t.lr, "weight_decay": t.weight_decay,
              "grad_clip": t.grad_clip, "kl_beta": cfg.algo.kl_beta, "timestep_fraction": cfg.algo.timestep_fraction,
              "reward": cfg.reward.weights, "seed": cfg.run.seed,
              "tables": {name: dataclasses.asdict(getattr(cfg, name)) for name in ("algo", "train", "rollout")}}
    return json.loads(json.dumps(record))


def eval_record(cfg: MegaflowConfig, eval_every: int, eval_num: int) -> dict:
    """What a report records of its evaluation."""
    e = cfg.eval
    return {"num": e.num, "num_seen": e.num_seen, "seed": e.seed, "eval_every": eval_every, "eval_num": eval_num}


def bench_learn(cfg: MegaflowConfig, *, side: str = "both", eval_every: int = 0, eval_num: int = 100,
                target_gain: float = 0.05) -> dict:
    """Run the chosen side(s) one after the other; one JSON-able report (the module's design notes)."""
    if side not in (*SIDES, "both"):
        raise ValueError(f"--side must be baseline, megaflow or both, got {side!r}")
    if eval_every < 0 or eval_num < 1:
        raise ValueError(f"--eval-every must be >= 0 and --eval-num >= 1, got {eval_every} / {eval_num}")
    out = {"recipe": recipe_record(cfg), "eval": eval_record(cfg, eval_every, eval_num), "target_gain": target_gain,
           "sides": {}}
    runners = {"baseline": run_baseline, "megaflow": run_megaflow}
    for name in SIDES if side == "both" else (side,):
        out["sides"][name] = runners[name](cfg, eval_every=eval_every, eval_num=eval_num, target_gain=target_gain)
    sides = out["sides"]
    if len(sides) == 2:
        b, m = sides["baseline"], sides["megaflow"]
        out["rl_speedup"] = b["s_per_iteration"] / m["s_per_iteration"]
        if b["curve"] and m["curve"]:  # the largest gain both sides reached, and when each first did
            best = lambda c: max(p["accuracy"] - c[0]["accuracy"] for p in c)  # noqa: E731
            common = min(best(b["curve"]), best(m["curve"]))
            out["common_gain"] = common
            out["time_to_common_gain_s"] = ({k: time_to_gain(s["curve"], common) for k, s in sides.items()}
                                            if common > 0 else None)
    return out
