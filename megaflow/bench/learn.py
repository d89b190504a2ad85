"""``megaflow bench learn``: the demo's RL recipe through a plain single-process loop vs megaflow.

Both sides start from the same pipeline and run the same iterations on the same prompts
(``run.build.prompt_stream``), request seeds and SDE windows (``run.flowgrpo.make_requests``), reward and
group advantages (``run.flowgrpo.generate_and_score``), trained steps (``run.flowgrpo.train_steps``) and
optimizer-step plan (``grpo_batches.plan_updates``, same seed):

- baseline: ``DiffusersEngine`` rollouts (one batched diffusers loop) and a plain torch FlowGRPO step on
  its ``SD3Transformer2DModel`` (``plain_update``: log-probs from ``flow.step.transition_log_prob``, loss
  ``algo.loss.flow_grpo_loss`` with every (sample, step) item of an optimizer step weighted 1/N,
  ``torch.optim.AdamW`` with megatron's weight-decay groups (none on biases and 1-D params) and
  ``clip_grad_norm_``); the engine samples with the trained module itself, so there is no weight sync;
- megaflow: ``run.loop.run`` (SGLang engine, megatron-core trainer, verified weight sync).

Held-out ShapeEval (``[eval]``: ODE, fixed prompts and seeds) before and after on each side's own engine;
with ``eval_every`` a smaller held-out set (``eval_num`` prompts) every N iterations gives a learning
curve against RL wall time (evaluation and start-up excluded), and the time each side first reached a
held-out gain. The engines' SDE noise streams differ, so the sides' rollouts (and rewards) are not
bit-equal for the same seeds; their ODE evaluations of the same weights agree (same initial noise).

    megaflow bench learn -c configs/shapes_demo.toml --eval-every 10 --json --out runs/learn.json
"""
from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path

import torch

from megaflow.algo.loss import flow_grpo_loss
from megaflow.config import MegaflowConfig
from megaflow.flow.step import sigma_max_of, transition_log_prob, transition_mean_std
from megaflow.seeds import MINIBATCHES, iteration_seed

SIDES = ("baseline", "megaflow")


# ------------------------------------------------------------------ the plain FlowGRPO step
def _velocity(dit, x, sigma, cond: dict, guidance, num_train_timesteps: int) -> torch.Tensor:
    """Diffusers DiT velocity; under CFG one batch [uncond; cond] and v_u + g·(v_c − v_u)."""
    ehs, pooled = cond["encoder_hidden_states"], cond["pooled_projections"]
    if guidance is not None:
        x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
        ehs = torch.cat([cond["negative_encoder_hidden_states"], ehs])
        pooled = torch.cat([cond["negative_pooled_projections"], pooled])
    v = dit(hidden_states=x, timestep=sigma * num_train_timesteps, encoder_hidden_states=ehs,
            pooled_projections=pooled, return_dict=False)[0].float()
    if guidance is None:
        return v
    uncond, cond_v = v.chunk(2)
    return uncond + guidance.view(-1, 1, 1, 1) * (cond_v - uncond)


def _batch(trajs, advantages, items) -> dict:
    """Stacked tensors of (sample, step) items (outside inference mode: plain tensors autograd can save)."""
    tr = [trajs[i] for i, _ in items]
    st = lambda f: torch.stack([f(x, t) for x, (_, t) in zip(tr, items)])  # noqa: E731
    out = {"x": st(lambda x, t: x.latents[t]), "x_next": st(lambda x, t: x.latents[t + 1]),
           "sigma": st(lambda x, t: x.sigmas[t]).float(), "sigma_next": st(lambda x, t: x.sigmas[t + 1]).float(),
           "sigma_max": st(lambda x, t: sigma_max_of(x.sigmas)).float(),
           "old": st(lambda x, t: x.log_probs[t]).float(),
           "adv": torch.stack([advantages[i] for i, _ in items]).float(),
           "cond": {k: torch.stack([x.conditioning[k] for x in tr]) for k in tr[0].conditioning},
           "guidance": torch.tensor([float(x.guidance_scale) for x in tr]) if tr[0].do_cfg else None}
    return out


def plain_backward(dit, trajs, advantages, items, settings, *, ref=None, micro_batch_size: int = 32,
                   num_train_timesteps: int = 1000) -> dict:
    """Accumulate into ``dit``'s grads the FlowGRPO loss of ONE optimizer step over ``items``: each
    (sample, step) item weighs 1/N (N = len(items)), computed in chunks of ``micro_batch_size``.
    Returns item-weighted means of the loss stats."""
    n, sums = len(items), {}
    for lo in range(0, n, micro_batch_size):
        b = _batch(trajs, advantages, items[lo:lo + micro_batch_size])
        v = _velocity(dit, b["x"], b["sigma"], b["cond"], b["guidance"], num_train_timesteps)
        policy = transition_log_prob(b["x"], v, b["x_next"], b["sigma"], b["sigma_next"], sigma_max=b["sigma_max"],
                                     config=settings.transition)
        ref_mean = None
        if settings.loss.kl_beta > 0:
            with torch.no_grad():
                v_ref = _velocity(ref, b["x"], b["sigma"], b["cond"], b["guidance"], num_train_timesteps)
                ref_mean = transition_mean_std(b["x"], v_ref, b["sigma"], b["sigma_next"], sigma_max=b["sigma_max"],
                                               config=settings.transition)[0]
        loss, stats = flow_grpo_loss(policy, old_log_prob=b["old"], advantages=b["adv"], config=settings.loss,
                                     ref_mean=ref_mean, normalizer=n)
        loss.backward()
        for k, val in stats.items():
            sums[k] = sums.get(k, 0.0) + float(val) * len(b["adv"])
    return {k: val / n for k, val in sums.items()}


def plain_optimizer(dit, train) -> torch.optim.AdamW:
    """AdamW with the ``[train]`` lr / weight decay; no decay on biases and 1-D params (as megatron)."""
    decay = [p for name, p in dit.named_parameters() if p.dim() > 1 and not name.endswith(".bias")]
    rest = [p for name, p in dit.named_parameters() if not (p.dim() > 1 and not name.endswith(".bias"))]
    return torch.optim.AdamW([{"params": decay, "weight_decay": train.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=train.lr, betas=(0.9, 0.999), eps=1e-8)


def plain_update(dit, opt, trajs, advantages, keep, steps, settings, *, grad_clip: float, seed: int, ref=None,
                 num_train_timesteps: int = 1000) -> dict:
    """flow_grpo's training phase for one rollout batch in plain torch: every optimizer step of the plan."""
    from megaflow.trainer.grpo_batches import plan_updates
    kept = [i for i in range(len(keep)) if bool(keep[i])]
    plan = plan_updates(kept, steps, num_inner_epochs=settings.num_inner_epochs,
                        num_minibatches=settings.num_minibatches, seed=seed)
    norms, out = [], {}
    for items in plan:
        opt.zero_grad(set_to_none=True)
        stats = plain_backward(dit, trajs, advantages, items, settings, ref=ref,
                               micro_batch_size=settings.micro_batch_size, num_train_timesteps=num_train_timesteps)
        params = [p for p in dit.parameters() if p.grad is not None]
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))))
        opt.step()
        out = {k: out.get(k, 0.0) + val * len(items) for k, val in stats.items()}
    if not plan:
        return {"skipped": 1.0}
    total = sum(len(items) for items in plan)
    return {**{k: val / total for k, val in out.items()}, "grad_norm": sum(norms) / len(norms),
            "num_updates": len(plan)}


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
    """The plain loop (module doc); returns the side's summary plus setup_s and param_delta_l2."""
    from megaflow.rollout.baseline import DiffusersEngine, DiffusersEngineConfig
    from megaflow.run.build import build_scorer, prompt_stream, resolve_pipeline, with_pipeline_defaults
    from megaflow.run.flowgrpo import generate_and_score, grpo_settings, make_requests, train_steps

    t0 = time.perf_counter()
    torch.set_num_threads(cfg.run.num_threads)
    torch.manual_seed(cfg.run.seed)
    run_dir = Path(cfg.run.output_dir) / f"{cfg.run.name}-learn-baseline"
    pipeline_dir = resolve_pipeline(cfg, run_dir)
    cfg = with_pipeline_defaults(cfg, pipeline_dir)
    if cfg.algo.mismatch != "none":
        raise ValueError("bench learn: the plain loop samples with the trained module itself; use algo.mismatch = none")
    settings = grpo_settings(cfg)
    engine = DiffusersEngine.from_pretrained(str(pipeline_dir), config=DiffusersEngineConfig(engine_id="baseline"))
    dit = engine.transformer.requires_grad_(True)
    ref = copy.deepcopy(dit).requires_grad_(False) if settings.loss.kl_beta > 0 else None
    opt = plain_optimizer(dit, cfg.train)
    initial = {k: v.detach().clone() for k, v in dit.named_parameters()}
    scorer, prompts = build_scorer(cfg), prompt_stream(cfg)
    tracker = _Tracker(cfg, run_dir, eval_every=eval_every, eval_num=eval_num)
    setup_s = time.perf_counter() - t0
    try:
        tracker.before(engine)
        for it in range(1, cfg.train.iterations + 1):
            t1 = time.perf_counter()
            trajs, adv, keep, metrics = generate_and_score(engine, scorer, make_requests(cfg, prompts, it), cfg)
            tracker.rewards.append(metrics["reward/total"])
            stats = plain_update(dit, opt, trajs, adv, keep, train_steps(cfg, settings.transition, it), settings,
                                 grad_clip=cfg.train.grad_clip, seed=iteration_seed(cfg.run.seed, it, MINIBATCHES),
                                 ref=ref, num_train_timesteps=engine.pipe.scheduler.config.num_train_timesteps)
            print(f"[bench learn] baseline iteration {it}/{cfg.train.iterations}: reward {metrics['reward/total']:.4f} "
                  f"loss {stats.get('loss', float('nan')):.4g} ({time.perf_counter() - t1:.1f} s)", flush=True)
            tracker.checkpoint(engine, it)
        tracker.after(engine)
    finally:
        scorer.close()
        engine.shutdown()
    delta = sum(float((p.detach() - initial[k]).double().pow(2).sum()) for k, p in dit.named_parameters()) ** 0.5
    return {**tracker.summary(target_gain), "setup_s": setup_s, "param_delta_l2": delta}


def run_megaflow(cfg: MegaflowConfig, *, eval_every: int = 0, eval_num: int = 100, target_gain: float = 0.05) -> dict:
    """``megaflow.run.loop.run`` with evaluation hooks (intermediate evals run before the next iteration's
    rollouts)."""
    from megaflow.run.build import resolve_pipeline, with_pipeline_defaults
    from megaflow.run.loop import run
    from megaflow.run.rundir import with_unused_name

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
    return {**tracker.summary(target_gain), "setup_s": setup.get("s")}


def bench_learn(cfg: MegaflowConfig, *, side: str = "both", eval_every: int = 0, eval_num: int = 100,
                target_gain: float = 0.05) -> dict:
    """Run the chosen side(s) one after the other; one JSON-able report (module doc)."""
    if side not in (*SIDES, "both"):
        raise ValueError(f"--side must be baseline, megaflow or both, got {side!r}")
    if eval_every < 0 or eval_num < 1:
        raise ValueError(f"--eval-every must be >= 0 and --eval-num >= 1, got {eval_every} / {eval_num}")
    r, t, e = cfg.rollout, cfg.train, cfg.eval
    out = {"recipe": {"pipeline": cfg.model.pretrained or "(tiny, made for the run)", "iterations": t.iterations,
                      "prompts_per_iter": r.prompts_per_iter, "group_size": r.group_size, "num_steps": r.num_steps,
                      "sde_type": r.sde_type, "noise_level": r.noise_level, "lr": t.lr, "weight_decay": t.weight_decay,
                      "grad_clip": t.grad_clip, "kl_beta": cfg.algo.kl_beta,
                      "timestep_fraction": cfg.algo.timestep_fraction,
                      "reward": cfg.reward.weights, "seed": cfg.run.seed},
           "eval": {"num": e.num, "num_seen": e.num_seen, "seed": e.seed, "eval_every": eval_every,
                    "eval_num": eval_num},
           "target_gain": target_gain, "sides": {}}
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
