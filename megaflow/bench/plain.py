"""The plain side of ``megaflow bench learn``: each update in plain torch on the diffusers DiT, sharing only the
losses and item plans with megaflow. Design notes: docs/design/bench.md.
"""
from __future__ import annotations

import copy
import contextlib

import torch

from megaflow.algo.flowgrpo import flow_grpo_loss
from megaflow.config import MegaflowConfig
from megaflow.flow.step import sigma_max_of, transition_log_prob, transition_mean_std
from megaflow.seeds import MINIBATCHES, iteration_seed


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
                 num_train_timesteps: int = 1000, on_step=None) -> dict:
    """flow_grpo's training phase for one rollout batch in plain torch: every optimizer step of the plan."""
    from megaflow.trainer.flowgrpo_batches import plan_updates
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
        if on_step is not None:
            on_step()
        out = {k: out.get(k, 0.0) + val * len(items) for k, val in stats.items()}
    if not plan:
        return {"skipped": 1.0}
    total = sum(len(items) for items in plan)
    return {**{k: val / total for k, val in out.items()}, "grad_norm": sum(norms) / len(norms),
            "num_updates": len(plan)}


# ------------------------------------------------------------------ the algorithms
def _set_lr(opt, cfg: MegaflowConfig, iteration: int) -> None:
    from megaflow.trainer.settings import scheduled_lr
    t = cfg.train
    lr = scheduled_lr(t.lr, iteration - 1, warmup=t.warmup_iterations, total=t.iterations, schedule=t.lr_schedule)
    for group in opt.param_groups:
        group["lr"] = lr


@torch.no_grad()
def _blend(dst: torch.nn.Module, src: torch.nn.Module, decay: float) -> None:
    """dst ← decay·dst + (1 − decay)·src over the parameters (decay 0 copies)."""
    for d, s in zip(dst.parameters(), src.parameters()):
        d.copy_(s) if decay == 0 else d.lerp_(s, 1.0 - decay)


class _PlainEMA:
    def __init__(self, dit, decay: float):
        self.module, self.decay, self.num_updates = copy.deepcopy(dit).requires_grad_(False), decay, 0

    def step(self, dit) -> None:
        from megaflow.trainer.shadow import ema_decay_at
        self.num_updates += 1
        _blend(self.module, dit, ema_decay_at(self.decay, self.num_updates))


class PlainFlowGRPO:
    """FlowGRPO on ``engine`` (a DiffusersEngine whose transformer is trained in place)."""

    def __init__(self, cfg: MegaflowConfig, engine):
        from megaflow.run.flowgrpo import grpo_settings
        self.cfg, self.engine, self.settings = cfg, engine, grpo_settings(cfg)
        self.dit = engine.transformer.requires_grad_(True)
        self.ref = copy.deepcopy(self.dit).requires_grad_(False) if self.settings.loss.kl_beta > 0 else None
        self.opt = plain_optimizer(self.dit, cfg.train)
        self.ema = _PlainEMA(self.dit, cfg.train.ema_decay) if cfg.train.ema_decay > 0 else None

    def requests(self, prompts, iteration: int):
        from megaflow.run.requests import make_requests
        return make_requests(self.cfg, prompts, iteration)

    def update(self, trajs, adv, keep, iteration: int) -> dict:
        from megaflow.run.flowgrpo import train_steps
        _set_lr(self.opt, self.cfg, iteration)
        return plain_update(self.dit, self.opt, trajs, adv, keep, train_steps(self.cfg, self.settings.transition,
                            iteration), self.settings, grad_clip=self.cfg.train.grad_clip,
                            seed=iteration_seed(self.cfg.run.seed, iteration, MINIBATCHES), ref=self.ref,
                            num_train_timesteps=self.engine.pipe.scheduler.config.num_train_timesteps,
                            on_step=(lambda: self.ema.step(self.dit)) if self.ema else None)

    def evaluated(self):
        """The engine samples the EMA (when on) inside the block."""
        return _swapped(self.engine, self.ema.module) if self.ema else contextlib.nullcontext()


@contextlib.contextmanager
def _swapped(engine, module):
    saved, engine.transformer = engine.transformer, module
    try:
        yield
    finally:
        engine.transformer = saved


class PlainNFT:
    """DiffusionNFT: the engine samples with θ_old; θ (``self.dit``) trains; the EMA evaluates."""

    def __init__(self, cfg: MegaflowConfig, engine):
        from megaflow.run.nft import nft_settings
        self.cfg, self.engine, self.settings = cfg, engine, nft_settings(cfg)
        self.old = engine.transformer  # the sampler's module is θ_old
        self.dit = copy.deepcopy(self.old).requires_grad_(True)
        self.ref = copy.deepcopy(self.old) if self.settings.loss.kl_beta > 0 else None
        self.opt = plain_optimizer(self.dit, cfg.train)
        self.ema = _PlainEMA(self.dit, cfg.train.ema_decay) if cfg.train.ema_decay > 0 else None
        self.ntt = engine.pipe.scheduler.config.num_train_timesteps
        self.steps = 0  # optimizer steps so far: θ_old's schedule reads them

    def requests(self, prompts, iteration: int):
        from megaflow.run.requests import make_requests
        return make_requests(self.cfg, prompts, iteration)

    def _v(self, dit, x, t, cond):
        return dit(hidden_states=x, timestep=t * self.ntt, encoder_hidden_states=cond["encoder_hidden_states"],
                   pooled_projections=cond["pooled_projections"], return_dict=False)[0].float()

    def update(self, trajs, adv, keep, iteration: int) -> dict:
        from megaflow.algo.nft import nft_loss, noised, old_policy_decay
        from megaflow.trainer.nft import plan_items
        _set_lr(self.opt, self.cfg, iteration)
        g = torch.Generator().manual_seed(iteration_seed(self.cfg.run.seed, iteration, MINIBATCHES))
        kept = [i for i in range(len(keep)) if bool(keep[i])]
        plan = plan_items(kept, len(trajs[0].sigmas) - 1, self.settings, g) if kept else []
        shape, norms, losses = trajs[0].latents[-1].shape, [], []
        noise = [[torch.randn(shape, generator=g) for _ in items] for items in plan]
        for items, eps in zip(plan, noise):
            self.opt.zero_grad(set_to_none=True)
            for lo in range(0, len(items), self.settings.micro_batch_size):
                chunk = items[lo:lo + self.settings.micro_batch_size]
                tr = [trajs[i] for i, _ in chunk]
                x0 = torch.stack([x.latents[-1] for x in tr]).float()
                t = torch.stack([x.sigmas[k] for x, (_, k) in zip(tr, chunk)]).float()
                xt = noised(x0, torch.stack(eps[lo:lo + len(chunk)]), t)
                cond = {k: torch.stack([x.conditioning[k] for x in tr]) for k in ("encoder_hidden_states",
                                                                                   "pooled_projections")}
                with torch.no_grad():
                    v_old = self._v(self.old, xt, t, cond)
                    v_ref = self._v(self.ref, xt, t, cond) if self.ref is not None else None
                loss, _ = nft_loss(self._v(self.dit, xt, t, cond), v_old, x0, xt, t,
                                   torch.stack([adv[i] for i, _ in chunk]), config=self.settings.loss,
                                   ref_velocity=v_ref, normalizer=len(items))
                loss.backward()
                losses.append(float(loss.detach()))
            clip = self.cfg.train.grad_clip or float("inf")
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(self.dit.parameters()), clip)))
            self.opt.step()
            if self.ema is not None:
                self.ema.step(self.dit)
        a, self.steps = self.cfg.algo, self.steps + len(plan)
        _blend(self.old, self.dit, old_policy_decay(self.steps, rate=a.old_decay_rate, max_decay=a.old_decay_max,
                                                    flat_steps=a.old_decay_flat_steps))
        return {"loss": sum(losses), "grad_norm": sum(norms) / max(1, len(norms)), "num_updates": len(plan)}

    def evaluated(self):
        return _swapped(self.engine, (self.ema.module if self.ema else self.dit))


def plain_algorithm(cfg: MegaflowConfig, engine):
    """The plain loop's algorithm of ``algo.name``."""
    return {"flowgrpo": PlainFlowGRPO, "nft": PlainNFT}[cfg.algo.name](cfg, engine)
