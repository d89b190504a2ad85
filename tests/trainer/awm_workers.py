"""Rank function and the plain-torch AWM reference for tests/trainer/test_awm_update.py.

``awm_reference`` is a transcription, written for these tests, of one AWM training phase on the diffusers DiT
in plain torch (no megaflow math), from the objective in docs/algorithms/awm.md: for every item (sample i, grid
index k) x_t = (1 − t)·x0 + t·ε, ℓ = mean((v − (ε − x0))²) in float64, W = t·((ℓ + δ)^p − δ^p)/p (ghuber),
logp = −W; the ratio ρ = exp(logp − logp_old) with logp_old from the weights before the phase's first step
(on the first step ρ ≡ 1 with logp_old = logp detached); A' = clip(A, −c, c)/c; per item
max(−A'ρ, −A'·clip(ρ, 1 − ε, 1 + ε)) + κ·mean((v − v_ref)²) + κ_e·mean((v − v_ema)²), averaged over the step's
items; one SGD step each. The item plan and the noise are inputs (data shared with the trainer run); the math
is independent of megaflow.algo.awm.
"""
from __future__ import annotations

import megaflow  # noqa: F401  (import guards before megatron)
import torch

import nft_workers as N

SEED = 23
ADV_CLIP, KL, EMA_KL, POWER, CLIP = 5.0, 0.3, 0.7, 0.25, 2e-3
_DELTA = 1e-10


def plan_and_noise(trajs, *, num_timesteps: int, num_minibatches: int):
    """The trainer's item plan and noise for SEED (the data both sides train on)."""
    from megaflow.algo.awm import AWMConfig
    from megaflow.trainer.awm import AWMSettings, plan_awm_items
    g = torch.Generator().manual_seed(SEED)
    settings = AWMSettings(loss=AWMConfig(), num_timesteps=num_timesteps, num_minibatches=num_minibatches)
    plan = plan_awm_items([i for i in range(len(trajs)) if bool(N.KEEP[i])], N.STEPS, settings, g)
    shape = trajs[0].latents[-1].shape
    return plan, [[torch.randn(shape, generator=g) for _ in items] for items in plan]


def _w(v, x0, eps, t):
    err = (v.double() - (eps.double() - x0.double())).pow(2).mean()
    return t.double() * ((err + _DELTA) ** POWER - _DELTA ** POWER) / POWER, err


def _inputs(tr, k, e):
    t = tr.sigmas[k].reshape(1)
    x0 = tr.latents[-1][None]
    xt = (1 - t) * x0 + t * e[None]
    return t, x0, xt, tr.conditioning["encoder_hidden_states"][None], tr.conditioning["pooled_projections"][None]


def awm_reference(*, lr: float, num_timesteps: int, num_minibatches: int) -> dict:
    """Plain-torch AWM phase (module doc): the final DiT state and the per-step means of the loss terms."""
    dit, ema, ref, trajs = N.sample_case()
    plan, noise = plan_and_noise(trajs, num_timesteps=num_timesteps, num_minibatches=num_minibatches)
    before = {k: v.detach().clone() for k, v in dit.state_dict().items()}
    old_logp = {}
    with torch.no_grad():  # the weights before the first step: the ratio's policy of every later step
        for items, eps in zip(plan, noise):
            for (i, k), e in zip(items, eps):
                t, x0, xt, ehs, pooled = _inputs(trajs[i], k, e)
                old_logp[i, k] = -_w(N._v(dit, xt, t, ehs, pooled), x0, e[None], t)[0]
    steps = []
    for n, (items, eps) in enumerate(zip(plan, noise)):
        dit.zero_grad(set_to_none=True)
        total, sums = 0.0, {"policy_loss": 0.0, "kl": 0.0, "ema_kl": 0.0, "clip_frac": 0.0}
        for (i, k), e in zip(items, eps):
            t, x0, xt, ehs, pooled = _inputs(trajs[i], k, e)
            with torch.no_grad():
                v_ema, v_ref = N._v(ema, xt, t, ehs, pooled), N._v(ref, xt, t, ehs, pooled)
            v = N._v(dit, xt, t, ehs, pooled)
            logp = -_w(v, x0, e[None], t)[0]
            rho = torch.exp(logp - (logp.detach() if n == 0 else old_logp[i, k]))
            a = float(N.ADV[i].clamp(-ADV_CLIP, ADV_CLIP)) / ADV_CLIP
            policy = torch.maximum(-a * rho, -a * rho.clamp(1 - CLIP, 1 + CLIP))
            kl, ema_kl = (v - v_ref).double().pow(2).mean(), (v - v_ema).double().pow(2).mean()
            total = total + policy + KL * kl + EMA_KL * ema_kl
            for key, value in (("policy_loss", policy), ("kl", kl), ("ema_kl", ema_kl),
                               ("clip_frac", (rho - 1).abs() > CLIP)):
                sums[key] += float(torch.as_tensor(value).detach())
        (total / len(items)).sum().backward()
        with torch.no_grad():
            for p in dit.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
        steps.append({key: value / len(items) for key, value in sums.items()})
    return {"before": before, "state": {k: v.detach().clone() for k, v in dit.state_dict().items()},
            "steps": steps}


def awm_rank(tp: int, micro_batch_size: int, case: dict) -> dict:
    """The same phase through ``megaflow.trainer.awm.awm_update`` at TP=``tp`` (DP = world / tp): the fast EMA
    a ShadowWeights holding the perturbed DiT (``case["on_policy"]``: θ itself), the reference a ReferenceModel;
    ``case["lora"]``: rank-4 adapters on a frozen base (on-policy only). Returns the final full state (diffusers
    names; under LoRA the adapters), the stats and the fast EMA's tensor names."""
    from megatron.core.optimizer import OptimizerConfig

    from megaflow.algo.awm import AWMConfig
    from megaflow.models.sd3 import from_diffusers
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed
    from megaflow.trainer.awm import AWMSettings, awm_update
    from megaflow.trainer.runner import ReferenceModel, Trainer
    from megaflow.trainer.shadow import ShadowWeights

    dit, ema_dit, ref_dit, trajs = N.sample_case()
    init_distributed(ParallelDims(tp=tp), seed=0)
    opt = OptimizerConfig(optimizer="sgd", lr=case["lr"], weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0,
                          use_distributed_optimizer=False)
    lora = N.lora_settings() if case.get("lora") else None
    assert lora is None or case.get("on_policy"), "a LoRA fast EMA starts at the adapters (B = 0): θ itself"
    eng = Trainer(from_diffusers(N.dit_config(), tensor_model_parallel_size=tp), spec="local", optimizer_config=opt,
                  lora=lora)
    ref = ReferenceModel(from_diffusers(N.dit_config(), tensor_model_parallel_size=tp), spec="local")
    ref.load_diffusers_state_dict(ref_dit.state_dict())
    eng.load_diffusers_state_dict((dit if case.get("on_policy") else ema_dit).state_dict())
    ema_kl = ShadowWeights.of(eng.chunks)
    eng.load_diffusers_state_dict(dit.state_dict())
    loss = AWMConfig(adv_clip=ADV_CLIP, awm_ghuber_power=POWER, awm_clip_range=CLIP, kl_beta=KL,
                     awm_ema_kl_beta=EMA_KL)
    settings = AWMSettings(loss=loss, num_timesteps=case["num_timesteps"], num_minibatches=case["num_minibatches"],
                           micro_batch_size=micro_batch_size)
    stats = awm_update(eng, trajs, N.ADV, N.KEEP, settings, generator=torch.Generator().manual_seed(SEED),
                       ema_kl=ema_kl, ref=ref, device=torch.device("cpu"))
    if lora is not None:
        state = {k: v.clone() for k, v in eng.iter_full_adapters()}
    else:
        state = eng.family.weight_map.to_diffusers({k: v.clone() for k, v in eng.iter_full_params()}, eng.config)
    destroy_distributed()
    return {"state": state, "stats": stats, "shadow_names": sorted(ema_kl.tensors)}
