"""Rank functions and the plain-torch flow_grpo reference for tests/trainer/test_grpo_semantics.py.

``flow_grpo_reference`` is a transcription, written for these tests, of the training loop of flow_grpo's
``scripts/train_sd3.py`` (diffusers DiT, plain torch, no megaflow code in the math): per inner epoch the
samples are permuted and split into minibatches; per minibatch, for each trained timestep j the loss
mean_b(max(−A·ρ, −A·clip(ρ))) + β·mean_b(mean_elem((μ − μ_ref)²) / (2·std_dev_t²)) is backpropagated
divided by the number of timesteps (accelerate's gradient accumulation over timesteps), then one
optimizer step. ρ = exp(logp − logp_sampling). CFG: both branches in one batch [uncond; cond],
v = v_u + g·(v_c − v_u). The SDE log-prob is flow_grpo's ``sde_step_with_logprob`` formula.
"""
from __future__ import annotations

import copy
import dataclasses
import math

import megaflow  # noqa: F401  (import guards before megatron)
import torch

STEPS = 4           # denoising steps; timestep_fraction 0.99 trains steps 0, 1, 2
NOISE_LEVEL = 0.7


def dit_config() -> dict:
    from megaflow.models.sd3 import tiny
    return tiny.tiny_config(num_layers=2)


def sample_case(num: int, *, seed: int, guidance: float = 1.0):
    """A random diffusers DiT and ``num`` SDE trajectories sampled from it (CFG when guidance > 1)."""
    from megaflow.flow.schedule import sd3_sigmas
    from megaflow.flow.step import TransitionConfig, sigma_max_of, step
    from megaflow.models.sd3 import tiny
    from megaflow.rollout.types import Trajectory

    dcfg = dit_config()
    dit = tiny.diffusers_model(dcfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    sigmas = sd3_sigmas(STEPS, shift=3.0).float()
    cfg = TransitionConfig(kind="sde", noise_level=NOISE_LEVEL)
    ehs = torch.randn(num, 6, dcfg["joint_attention_dim"], generator=g)
    pooled = torch.randn(num, dcfg["pooled_projection_dim"], generator=g)
    neg_ehs = torch.randn(1, 6, dcfg["joint_attention_dim"], generator=g).expand(num, -1, -1).contiguous()
    neg_pooled = torch.randn(1, dcfg["pooled_projection_dim"], generator=g).expand(num, -1).contiguous()
    x = torch.randn(num, dcfg["in_channels"], 8, 8, generator=g)
    lat, lps = [x], []
    with torch.no_grad():
        for t in range(STEPS):
            v = velocity(dit, x, sigmas[t].expand(num), ehs, pooled, neg_ehs, neg_pooled, guidance)
            r = step(x, v, sigmas[t], sigmas[t + 1], sigma_max=sigma_max_of(sigmas), config=cfg,
                     noise=torch.randn(x.shape, generator=g))
            x = r.sample
            lat.append(x)
            lps.append(r.log_prob)
    lat, lps = torch.stack(lat, 1), torch.stack(lps, 1)
    do_cfg = guidance > 1
    trajs = []
    for i in range(num):
        cond = {"encoder_hidden_states": ehs[i], "pooled_projections": pooled[i]}
        if do_cfg:
            cond.update(negative_encoder_hidden_states=neg_ehs[i], negative_pooled_projections=neg_pooled[i])
        trajs.append(Trajectory(request_id="g0", index=i, prompt="p", seed=seed + i, latents=lat[i], sigmas=sigmas,
                                log_probs=lps[i], sde_mask=torch.ones(STEPS, dtype=torch.bool), sde_type="sde",
                                noise_level=NOISE_LEVEL, log_prob_no_const=False, guidance_scale=guidance,
                                do_cfg=do_cfg, conditioning=cond))
    return dit, trajs


def velocity(dit, x, sigma, ehs, pooled, neg_ehs, neg_pooled, guidance):
    """flow_grpo's ``compute_log_prob`` forward: one batch [uncond; cond] under CFG."""
    if guidance <= 1:
        return dit(hidden_states=x, timestep=sigma * 1000, encoder_hidden_states=ehs, pooled_projections=pooled).sample
    out = dit(hidden_states=torch.cat([x, x]), timestep=torch.cat([sigma, sigma]) * 1000,
              encoder_hidden_states=torch.cat([neg_ehs, ehs]),
              pooled_projections=torch.cat([neg_pooled, pooled])).sample
    uncond, cond = out.chunk(2)
    return uncond + guidance * (cond - uncond)


def sde_log_prob(x, v, x_next, sigma, sigma_next, sigma_max):
    """flow_grpo ``sde_step_with_logprob`` with prev_sample given: (log_prob [B], mean, std_dev_t [B])."""
    s = sigma.view(-1, 1, 1, 1)
    dt = sigma_next.view(-1, 1, 1, 1) - s
    std_dev_t = torch.sqrt(s / (1 - torch.where(s == 1, sigma_max, s))) * NOISE_LEVEL
    mean = x * (1 + std_dev_t ** 2 / (2 * s) * dt) + v * (1 + std_dev_t ** 2 * (1 - s) / (2 * s)) * dt
    std = std_dev_t * torch.sqrt(-dt)
    lp = -((x_next.detach() - mean) ** 2) / (2 * std ** 2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    return lp.mean(dim=(1, 2, 3)), mean, std_dev_t.flatten()


def _stack(trajs):
    t0 = trajs[0]
    cond = {k: torch.stack([t.conditioning[k] for t in trajs]) for k in t0.conditioning}
    return dict(latents=torch.stack([t.latents for t in trajs]), log_probs=torch.stack([t.log_probs for t in trajs]),
                sigmas=t0.sigmas, ehs=cond["encoder_hidden_states"], pooled=cond["pooled_projections"],
                neg_ehs=cond.get("negative_encoder_hidden_states"), neg_pooled=cond.get("negative_pooled_projections"),
                guidance=t0.guidance_scale)


def flow_grpo_reference(dit, ref_dit, trajs, advantages, *, steps, epochs=1, minibatches=1, seed=0, lr=0.0,
                        clip_range=1e-4, beta=0.0) -> dict:
    """flow_grpo's training loop (module doc) with SGD(lr); the sample / timestep order uses the same
    seeded draws as megaflow's plan (randperm of samples, then of timesteps, per epoch; none for 1 x 1).
    Returns the first step's grads, the final state, and per-step clip fractions."""
    s = _stack(trajs)
    opt = torch.optim.SGD(dit.parameters(), lr=lr)
    sigma_max = s["sigmas"][1]
    n = len(trajs)
    g = torch.Generator().manual_seed(seed)
    out = {"clip_frac": [], "first_grads": None}
    for _ in range(epochs):
        if epochs == 1 and minibatches == 1:
            perm, order = torch.arange(n), list(steps)
        else:
            perm = torch.randperm(n, generator=g)
            order = [steps[j] for j in torch.randperm(len(steps), generator=g).tolist()]
        for idx in torch.tensor_split(perm, minibatches):
            opt.zero_grad()
            clipped = []
            for j in order:
                args = (s["ehs"][idx], s["pooled"][idx], None if s["neg_ehs"] is None else s["neg_ehs"][idx],
                        None if s["neg_pooled"] is None else s["neg_pooled"][idx], s["guidance"])
                x, x_next = s["latents"][idx, j], s["latents"][idx, j + 1]
                sig, sig_next = s["sigmas"][j].expand(len(idx)), s["sigmas"][j + 1].expand(len(idx))
                v = velocity(dit, x, sig, *args)
                log_prob, mean, std_dev_t = sde_log_prob(x, v, x_next, sig, sig_next, sigma_max)
                adv = advantages[idx]
                ratio = torch.exp(log_prob - s["log_probs"][idx, j])
                clipped_ratio = torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
                loss = torch.mean(torch.maximum(-adv * ratio, -adv * clipped_ratio))
                if beta > 0:
                    with torch.no_grad():
                        _, ref_mean, _ = sde_log_prob(x, velocity(ref_dit, x, sig, *args), x_next, sig, sig_next,
                                                      sigma_max)
                    kl = ((mean - ref_mean) ** 2).mean(dim=(1, 2, 3)) / (2 * std_dev_t ** 2)
                    loss = loss + beta * kl.mean()
                (loss / len(order)).backward()
                clipped.append((torch.abs(ratio - 1) > clip_range).float().detach())
            out["clip_frac"].append(float(torch.cat(clipped).mean()))
            if out["first_grads"] is None:
                out["first_grads"] = {k: p.grad.detach().clone() for k, p in dit.named_parameters()}
            opt.step()
    out["state"] = {k: v.detach().clone() for k, v in dit.state_dict().items()}
    return out


def _engine(dcfg, *, optimizer: bool, lr: float):
    from megatron.core.optimizer import OptimizerConfig

    from megaflow.models.sd3 import from_diffusers
    from megaflow.trainer.runner import Trainer

    opt = OptimizerConfig(optimizer="sgd", lr=lr, weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0,
                          use_distributed_optimizer=False) if optimizer else None
    return Trainer(from_diffusers(dcfg), spec="local", optimizer_config=opt)


def _diffusers_names(eng, tensors: dict) -> dict:
    return eng.family.weight_map.to_diffusers(tensors, eng.config)


def _grads(eng) -> dict:
    """The accumulated grads in diffusers names (buffers, which have none, as zeros)."""
    full = {k: torch.zeros_like(v) for k, v in eng.iter_full_params()}
    full.update({k: v.clone() for k, v in eng.iter_full_grads()})
    return _diffusers_names(eng, full)


def _settings(*, mbs, epochs=1, minibatches=1, beta=0.0, mismatch=None):
    from megaflow.algo.flowgrpo import LossConfig, MismatchConfig
    from megaflow.flow.step import TransitionConfig
    from megaflow.trainer.flowgrpo import GRPOSettings

    return GRPOSettings(transition=TransitionConfig(kind="sde", noise_level=NOISE_LEVEL),
                        loss=LossConfig(clip_range=1e-4, kl_beta=beta), micro_batch_size=mbs,
                        num_inner_epochs=epochs, num_minibatches=minibatches,
                        mismatch=None if mismatch is None else MismatchConfig(mismatch=mismatch, mismatch_cap=2.0))


def _perturbed(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def train_steps():
    from megaflow.algo.flowgrpo import train_step_indices
    from megaflow.flow.step import TransitionConfig
    return train_step_indices(STEPS, TransitionConfig(kind="sde"), timestep_fraction=0.99)


def equal_weight_rank(micro_batch_sizes: list[int], guidance: float = 1.0) -> dict:
    """One optimizer step (β > 0, a perturbed reference) for each micro_batch_size from the same
    weights: the step's grads (diffusers names, on every rank) and stats. 7 samples, one dropped by
    the zero-std filter (keep=False): 6 x 3 trained steps = 18 items."""
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed
    from megaflow.trainer.flowgrpo import grpo_update

    dit, trajs = sample_case(7, seed=3, guidance=guidance)
    state = {k: v.detach().clone() for k, v in dit.state_dict().items()}
    init_distributed(ParallelDims(), seed=0)
    eng, ref = _engine(dit_config(), optimizer=True, lr=1e-3), _engine(dit_config(), optimizer=False, lr=0.0)
    ref.load_diffusers_state_dict(_perturbed(state, 9))
    adv = torch.tensor([1.5, -0.5, 0.25, -2.0, 0.75, -1.0, 0.0])
    keep = torch.tensor([True] * 6 + [False])
    out = {}
    for mbs in micro_batch_sizes:
        eng.load_diffusers_state_dict(state)
        stats = grpo_update(eng, trajs, adv, keep, train_steps(), _settings(mbs=mbs, beta=0.04), ref,
                            device=torch.device("cpu"))
        out[mbs] = {"grads": _grads(eng), "stats": stats}
    if guidance > 1:  # control: the same CFG trajectories recomputed WITHOUT the guided velocity
        eng.load_diffusers_state_dict(state)
        plain = [dataclasses.replace(t, do_cfg=False, guidance_scale=1.0) for t in trajs]
        out["without_cfg"] = grpo_update(eng, plain, adv, keep, train_steps(), _settings(mbs=16, beta=0.04), ref,
                                         device=torch.device("cpu"))
    destroy_distributed()
    return out


def reference_grads(guidance: float = 1.0) -> dict:
    """The same step through ``flow_grpo_reference`` (diffusers, plain torch)."""
    dit, trajs = sample_case(7, seed=3, guidance=guidance)
    ref_dit = copy.deepcopy(dit)
    ref_dit.load_state_dict(_perturbed(dit.state_dict(), 9))
    adv = torch.tensor([1.5, -0.5, 0.25, -2.0, 0.75, -1.0])
    return flow_grpo_reference(dit, ref_dit, trajs[:6], adv, steps=train_steps(), beta=0.04)["first_grads"]


def multi_update_rank(lr: float, mismatch: str | None = None) -> dict:
    """2 inner epochs x 2 minibatches (4 SGD steps) over 6 samples; final weights and stats."""
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed
    from megaflow.trainer.flowgrpo import grpo_update

    dit, trajs = sample_case(6, seed=5)
    init_distributed(ParallelDims(), seed=0)
    eng = _engine(dit_config(), optimizer=True, lr=lr)
    eng.load_diffusers_state_dict(dit.state_dict())
    stats = grpo_update(eng, trajs, MULTI_ADV, torch.ones(6, dtype=torch.bool), train_steps(),
                        _settings(mbs=4, epochs=2, minibatches=2, mismatch=mismatch), seed=MULTI_SEED,
                        device=torch.device("cpu"))
    state = _diffusers_names(eng, {k: v.clone() for k, v in eng.iter_full_params()})
    destroy_distributed()
    return {"state": state, "stats": stats}


MULTI_SEED = 11
MULTI_ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])


def multi_update_reference(lr: float) -> dict:
    dit, trajs = sample_case(6, seed=5)
    before = {k: v.detach().clone() for k, v in dit.state_dict().items()}
    out = flow_grpo_reference(dit, None, trajs, MULTI_ADV, steps=train_steps(), epochs=2, minibatches=2,
                              seed=MULTI_SEED, lr=lr)
    out["before"] = before
    return out


def engine_log_prob_rank(pipeline_dir: str, trajs_path: str) -> dict:
    """Max |trainer log-prob − engine log-prob| over every step of engine trajectories, with the
    guided velocity (as sampled) and, as a control, with the conditional branch alone."""
    from pathlib import Path

    from megaflow.run.build import build_trainer
    from megaflow.config import load_config
    from megaflow.flow.step import TransitionConfig
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed
    from megaflow.trainer.batch import batch_conditioning
    from megaflow.trainer.flowgrpo import _policy
    from megaflow.trainer.flowgrpo_batches import microbatches_for

    trajs = torch.load(trajs_path, weights_only=False)
    init_distributed(ParallelDims(), seed=0)
    eng, _ = build_trainer(load_config(None), Path(pipeline_dir))
    transition = TransitionConfig(kind="sde", noise_level=trajs[0].noise_level)
    items = [(i, t) for i in range(len(trajs)) for t in range(trajs[0].num_steps)]
    out = {}
    for name, batch in (("cfg", trajs), ("no_cfg", [dataclasses.replace(t, do_cfg=False) for t in trajs])):
        mbs = microbatches_for(batch, torch.zeros(len(batch)), items, 8, torch.device("cpu"),
                               conditioning=batch_conditioning(eng))
        diffs = [(_policy(v, mb, transition).log_prob - mb["rollout_log_prob"]).abs()[mb["real"]]
                 for mb, v in zip(mbs, eng.forward_backward(mbs, None, forward_only=True))]
        out[name] = float(torch.cat(diffs).max())
    destroy_distributed()
    return out
