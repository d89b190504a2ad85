"""Rank function and the plain-torch DGPO reference for tests/trainer/test_dgpo_update.py.

``dgpo_reference`` is a transcription, written for these tests, of one DGPO optimizer step on the diffusers DiT
in plain torch (no megaflow math), from the objective in docs/algorithms/dgpo.md: every item (sample i, grid
index k) is x_t = (1 − t)·x0 + t·ε with ε shared by the prompt group at that k; ℓ = mean((v − (ε − x0))²) in
float64 for θ and for the fast EMA; per preference group g (prompt group × timestep)
s_g = (β/G)·Σ_{i∈g} clip(A_i)·(ℓ_i − ℓ_ema,i), where an item whose ratio exp(ℓ_ema − ℓ) left 1 ± ε in its
advantage's direction enters with ℓ detached; the loss [Σ_g (G/β)·softplus(s_g) + κ·Σ_i mean((v − v_ref)²)] / N,
one SGD step. The timesteps and the noise are inputs (data shared with the trainer run); the math is
independent of megaflow.algo.dgpo.
"""
from __future__ import annotations

import megaflow  # noqa: F401  (import guards before megatron)
import torch
import torch.nn.functional as F

import nft_workers as N

SEED = 29
GROUP = 4  # nft_workers' 7 samples: group 0 = samples 0..3, group 1 = samples 4..6 (6 not kept)
BETA, KL, CLIP, ADV_CLIP = 50.0, 0.3, 2e-3, 5.0


def settings(micro_batch_size: int = 4, num_timesteps: int = 2, trunc_steps: int = 2):
    from megaflow.algo.dgpo import DGPOConfig
    from megaflow.trainer.dgpo import DGPOSettings
    loss = DGPOConfig(dgpo_beta=BETA, dgpo_clip_range=CLIP, kl_beta=KL, adv_clip=ADV_CLIP)
    return DGPOSettings(loss=loss, group_size=GROUP, num_timesteps=num_timesteps, trunc_steps=trunc_steps,
                        micro_batch_size=micro_batch_size)


def plan(trajs):
    """The trainer's items, preference groups and noise for SEED (the data both sides train on)."""
    from megaflow.trainer.dgpo import plan_dgpo_items
    kept = [i for i in range(len(trajs)) if bool(N.KEEP[i])]
    return plan_dgpo_items(kept, N.STEPS, settings(), trajs[0].latents[-1].shape, torch.Generator().manual_seed(SEED))


def dgpo_reference(*, lr: float) -> dict:
    """Plain-torch DGPO step (module doc): the final DiT state, the loss and the clipped fraction."""
    dit, ema, ref, trajs = N.sample_case()
    items, groups, noise = plan(trajs)
    before = {k: v.detach().clone() for k, v in dit.state_dict().items()}
    dit.zero_grad(set_to_none=True)
    terms, kl_total, clipped = {}, 0.0, 0
    for (i, k), g, e in zip(items, groups.tolist(), noise):
        t, x0, xt, ehs, pooled = _inputs(trajs[i], k, e)
        with torch.no_grad():
            v_ema, v_ref = N._v(ema, xt, t, ehs, pooled), N._v(ref, xt, t, ehs, pooled)
        v = N._v(dit, xt, t, ehs, pooled)
        target = (e[None] - x0).double()
        err, err_ema = (v.double() - target).pow(2).mean(), (v_ema.double() - target).pow(2).mean()
        a = float(N.ADV[i].clamp(-ADV_CLIP, ADV_CLIP))
        ratio = float(torch.exp(err_ema - err))
        stop = ratio > 1 + CLIP if a > 0 else ratio < 1 - CLIP
        clipped += int(stop)
        terms[g] = terms.get(g, 0.0) + a * ((err.detach() if stop else err) - err_ema)
        kl_total = kl_total + (v - v_ref).double().pow(2).mean()
    total = sum(GROUP / BETA * F.softplus(BETA / GROUP * s) for s in terms.values()) + KL * kl_total
    loss = total / len(items)
    loss.backward()
    with torch.no_grad():
        for p in dit.parameters():
            if p.grad is not None:
                p -= lr * p.grad
    return {"before": before, "state": {k: v.detach().clone() for k, v in dit.state_dict().items()},
            "loss": float(loss), "clip_frac": clipped / len(items), "num_items": len(items)}


def _inputs(tr, k, e):
    t = tr.sigmas[k].reshape(1)
    x0 = tr.latents[-1][None]
    xt = (1 - t) * x0 + t * e[None]
    return t, x0, xt, tr.conditioning["encoder_hidden_states"][None], tr.conditioning["pooled_projections"][None]


def dgpo_rank(tp: int, micro_batch_size: int, case: dict) -> dict:
    """The same step through ``megaflow.trainer.dgpo.dgpo_update`` at TP=``tp`` (DP = world / tp): the fast EMA a
    ShadowWeights holding the perturbed DiT (``case["ema_state"]``: that diffusers state instead), the KL
    reference a ReferenceModel. ``case["lora"]``: rank-4 adapters (B = 0) on the DiT as a frozen base, the fast
    EMA the same adapters with B ~ N(0, 1) (TP=1 only). Returns the final full state (diffusers names; under
    LoRA the adapters, PEFT names), the stats, the loss the trainer's microbatches summed to, without LoRA the
    step's grads (diffusers names) and, under LoRA, the fast EMA merged into a diffusers state."""
    from megatron.core.optimizer import OptimizerConfig

    from megaflow.models.sd3 import from_diffusers
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed
    from megaflow.trainer import dgpo as trainer_dgpo
    from megaflow.trainer.runner import ReferenceModel, Trainer
    from megaflow.trainer.shadow import ShadowWeights

    dit, ema_dit, ref_dit, trajs = N.sample_case()
    init_distributed(ParallelDims(tp=tp), seed=0)
    opt = OptimizerConfig(optimizer="sgd", lr=case["lr"], weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0,
                          use_distributed_optimizer=False)
    lora = N.lora_settings() if case.get("lora") else None
    assert lora is None or tp == 1, "the fast EMA's B is drawn per local shard"
    eng = Trainer(from_diffusers(N.dit_config(), tensor_model_parallel_size=tp), spec="local", optimizer_config=opt,
                  lora=lora)
    ref = ReferenceModel(from_diffusers(N.dit_config(), tensor_model_parallel_size=tp), spec="local")
    ref.load_diffusers_state_dict(ref_dit.state_dict())
    ema_merged = None
    if lora is None:
        eng.load_diffusers_state_dict(case.get("ema_state") or ema_dit.state_dict())
        ema_ref = ShadowWeights.of(eng.chunks)
        eng.load_diffusers_state_dict(dit.state_dict())
    else:
        eng.load_diffusers_state_dict(dit.state_dict())
        ema_ref = ShadowWeights.of(eng.chunks)
        N.perturb_lora_b(ema_ref, SEED)
        with ema_ref.applied():
            adapters = {k: v.clone() for k, v in eng.iter_full_adapters()}
        ema_merged = N.merged_lora_state(dit.state_dict(), adapters, lora.scale)
    losses = []
    loss_fn = trainer_dgpo.dgpo_microbatch_loss

    def recording(*args, **kwargs):
        loss, stats = loss_fn(*args, **kwargs)
        losses.append(float(loss))
        return loss, stats

    trainer_dgpo.dgpo_microbatch_loss = recording
    try:
        stats = trainer_dgpo.dgpo_update(eng, trajs, N.ADV, N.KEEP, settings(micro_batch_size), ema_ref=ema_ref,
                                         ref=ref, generator=torch.Generator().manual_seed(SEED),
                                         device=torch.device("cpu"))
    finally:
        trainer_dgpo.dgpo_microbatch_loss = loss_fn
    # a microbatch returns Σ its items / normalizer, normalizer = N / (microbatches · DP) (megatron divides by both)
    dp = torch.distributed.get_world_size() // tp
    total = torch.tensor(sum(losses) / (len(losses) * dp), dtype=torch.float64)
    if torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(total)
        total /= tp  # every TP rank of a DP rank computes the same loss
    wm, grads = eng.family.weight_map, {}
    if lora is not None:
        state = {k: v.clone() for k, v in eng.iter_full_adapters()}
    else:
        state = wm.to_diffusers({k: v.clone() for k, v in eng.iter_full_params()}, eng.config)
        for name, grad in eng.iter_full_grads():  # the step's grads (diffusers names), kept after the step
            grads.update(wm.megatron_to_diffusers(name, grad.clone(), eng.config))
    destroy_distributed()
    return {"state": state, "stats": stats, "loss": float(total), "ema_merged": ema_merged, "grads": grads,
            "shadow_names": sorted(ema_ref.tensors)}
