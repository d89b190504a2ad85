"""Rank functions and the plain-torch DiffusionNFT reference for tests/trainer/test_nft_update.py.

``nft_reference`` is a transcription, written for these tests, of one DiffusionNFT training phase on the
diffusers DiT in plain torch (no megaflow math): per optimizer step, for every item (sample i, grid index k)
x_t = (1 − t)·x0 + t·ε; v_old from the sampling-policy DiT, v_ref from the reference DiT; the implicit
policies v± and their x0 predictions; the per-item loss c·(r·mse⁺/w⁺ + (1 − r)·mse⁻/w⁻)/β + κ·mse(v, v_ref),
averaged over the step's items; one SGD step. The item plan and the noise are inputs (data, shared with
the trainer run), the math is independent.
"""
from __future__ import annotations

import copy

import megaflow  # noqa: F401  (import guards before megatron)
import torch

STEPS = 4
ADV = torch.tensor([1.5, -0.5, 0.25, -2.0, 7.0, -1.0, 0.0])
KEEP = torch.tensor([True] * 6 + [False])
SEED = 21
BETA, ADV_CLIP, KL = 0.5, 5.0, 0.3


def dit_config() -> dict:
    from megaflow.models.sd3 import tiny
    return tiny.tiny_config(num_layers=2)


def sample_case(num: int = 7, seed: int = 3):
    """A random diffusers DiT, a perturbed copy (θ_old) and another (the reference), and ``num`` ODE
    trajectories sampled from θ_old."""
    from megaflow.flow.schedule import sd3_sigmas
    from megaflow.models.sd3 import tiny
    from megaflow.rollout.types import Trajectory

    dcfg = dit_config()
    dit = tiny.diffusers_model(dcfg, seed=seed)
    old, ref = copy.deepcopy(dit), copy.deepcopy(dit)
    old.load_state_dict(_perturbed(dit.state_dict(), seed + 10))
    ref.load_state_dict(_perturbed(dit.state_dict(), seed + 20))
    g = torch.Generator().manual_seed(seed + 1)
    sigmas = sd3_sigmas(STEPS, shift=3.0).float()
    ehs = torch.randn(num, 6, dcfg["joint_attention_dim"], generator=g)
    pooled = torch.randn(num, dcfg["pooled_projection_dim"], generator=g)
    x = torch.randn(num, dcfg["in_channels"], 8, 8, generator=g)
    lat = [x]
    with torch.no_grad():
        for t in range(STEPS):
            v = old(hidden_states=x, timestep=sigmas[t].expand(num) * 1000, encoder_hidden_states=ehs,
                    pooled_projections=pooled).sample
            x = x + (sigmas[t + 1] - sigmas[t]) * v
            lat.append(x)
    lat = torch.stack(lat, 1)
    trajs = [Trajectory(request_id=f"g{i // 4}", index=i % 4, prompt="p", seed=i, latents=lat[i], sigmas=sigmas,
                        log_probs=torch.zeros(STEPS), sde_mask=torch.zeros(STEPS, dtype=torch.bool), sde_type="ode",
                        noise_level=0.0, log_prob_no_const=False, guidance_scale=1.0, do_cfg=False,
                        conditioning={"encoder_hidden_states": ehs[i], "pooled_projections": pooled[i]})
             for i in range(num)]
    return dit, old, ref, trajs


def _perturbed(state: dict, seed: int) -> dict:
    """Every weight moved by N(0, 0.02²); the fixed sin-cos position table (a buffer, not trained) kept."""
    g = torch.Generator().manual_seed(seed)
    return {k: v if k.endswith("pos_embed.pos_embed") else v + 0.02 * torch.randn(v.shape, generator=g)
            for k, v in state.items()}


def lora_settings():
    """The adapters of the LoRA-equals-full tests (NFT, AWM, DGPO): rank 4, alpha 8 (scale 2)."""
    from megaflow.models.common.lora import LoRASettings
    return LoRASettings(rank=4, alpha=8.0)


def perturb_lora_b(shadow, seed: int, std: float = 1.0) -> None:
    """Set every B (``...lora.b``) a ShadowWeights holds to N(0, std²), from a generator seeded by ``seed``:
    a fast EMA that differs from θ (whose B is 0) in every adapted linear."""
    g = torch.Generator().manual_seed(seed)
    for name in sorted(n for n in shadow.tensors if n.endswith("lora.b")):
        t = shadow.tensors[name]
        t.copy_(std * torch.randn(t.shape, generator=g))


def merged_lora_state(base: dict, adapters: dict, scale: float) -> dict:
    """A diffusers state: ``base`` with W + scale·B@A for every PEFT adapter pair in ``adapters``
    (``<module>.lora_A.weight`` / ``.lora_B.weight``), as the engine merges them."""
    out = {k: v.clone() for k, v in base.items()}
    for name, a in adapters.items():
        if name.endswith(".lora_A.weight"):
            module = name.removesuffix(".lora_A.weight")
            b = adapters[f"{module}.lora_B.weight"]
            out[f"{module}.weight"] = base[f"{module}.weight"] + scale * (b.double() @ a.double()).float()
    return out


def plan_and_noise(trajs, *, num_timesteps: int, num_minibatches: int):
    """The trainer's item plan and noise for SEED (the data both sides train on)."""
    from megaflow.algo.nft import NFTConfig
    from megaflow.trainer.nft import NFTSettings, plan_items
    g = torch.Generator().manual_seed(SEED)
    settings = NFTSettings(loss=NFTConfig(), num_timesteps=num_timesteps, num_minibatches=num_minibatches)
    plan = plan_items([i for i in range(len(trajs)) if bool(KEEP[i])], STEPS, settings, g)
    shape = trajs[0].latents[-1].shape
    noise = [[torch.randn(shape, generator=g) for _ in items] for items in plan]
    return plan, noise


def _v(dit, x, t, ehs, pooled):
    return dit(hidden_states=x, timestep=t * 1000, encoder_hidden_states=ehs, pooled_projections=pooled).sample.float()


def nft_reference(*, lr: float, num_timesteps: int, num_minibatches: int) -> dict:
    """Plain-torch NFT phase (module doc): the final DiT state and the first step's grads."""
    dit, old, ref, trajs = sample_case()
    plan, noise = plan_and_noise(trajs, num_timesteps=num_timesteps, num_minibatches=num_minibatches)
    before = {k: v.detach().clone() for k, v in dit.state_dict().items()}
    first_grads, states = None, []
    for items, eps in zip(plan, noise):
        dit.zero_grad(set_to_none=True)
        total = 0.0
        for (i, k), e in zip(items, eps):
            tr = trajs[i]
            t = tr.sigmas[k].reshape(1)
            x0 = tr.latents[-1][None]
            xt = (1 - t) * x0 + t * e[None]
            ehs, pooled = tr.conditioning["encoder_hidden_states"][None], tr.conditioning["pooled_projections"][None]
            with torch.no_grad():
                v_old, v_ref = _v(old, xt, t, ehs, pooled), _v(ref, xt, t, ehs, pooled)
            v = _v(dit, xt, t, ehs, pooled)
            e_pos = xt - t * (BETA * v + (1 - BETA) * v_old) - x0
            e_neg = xt - t * ((1 + BETA) * v_old - BETA * v) - x0
            w_pos, w_neg = e_pos.detach().abs().mean().clamp(min=1e-5), e_neg.detach().abs().mean().clamp(min=1e-5)
            a = float(ADV[i].clamp(-ADV_CLIP, ADV_CLIP))
            r = min(1.0, max(0.0, 0.5 + a / (2 * ADV_CLIP)))
            item = ADV_CLIP * (r * e_pos.pow(2).mean() / w_pos + (1 - r) * e_neg.pow(2).mean() / w_neg) / BETA
            total = total + item + KL * (v - v_ref).pow(2).mean()
        (total / len(items)).backward()
        if first_grads is None:
            first_grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                           for n, p in dit.named_parameters()}
        with torch.no_grad():
            for p in dit.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
        states.append({k: v.detach().clone() for k, v in dit.state_dict().items()})
    return {"before": before, "state": states[-1], "states": states, "first_grads": first_grads}


def nft_rank(tp: int, micro_batch_size: int, case: dict) -> dict:
    """The same phase through ``megaflow.trainer.nft.nft_update`` at TP=``tp`` (DP = world / tp): θ_old is a
    ShadowWeights holding the perturbed DiT (``case["on_policy"]``: θ itself), the reference a ReferenceModel;
    ``case["lora"]``: rank-4 adapters on a frozen base. Returns the final full state (diffusers names; under LoRA
    the adapters, PEFT names), the stats, and an EMA's state after the phase."""
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig

    from megaflow.algo.nft import NFTConfig
    from megaflow.models.sd3 import from_diffusers
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed
    from megaflow.trainer.runner import ReferenceModel, Trainer
    from megaflow.trainer.nft import NFTSettings, nft_update
    from megaflow.trainer.shadow import EMA, ShadowWeights

    lr, num_timesteps, num_minibatches = case["lr"], case["num_timesteps"], case["num_minibatches"]
    dit, old_dit, ref_dit, trajs = sample_case()
    init_distributed(ParallelDims(tp=tp), seed=0)
    opt = OptimizerConfig(optimizer="sgd", lr=lr, weight_decay=0.0, clip_grad=0.0, sgd_momentum=0.0,
                          use_distributed_optimizer=False)
    lora = lora_settings() if case.get("lora") else None
    eng = Trainer(from_diffusers(dit_config(), tensor_model_parallel_size=tp), spec="local", optimizer_config=opt,
                  lora=lora)
    ref = ReferenceModel(from_diffusers(dit_config(), tensor_model_parallel_size=tp), spec="local")
    ref.load_diffusers_state_dict(ref_dit.state_dict())
    eng.load_diffusers_state_dict((dit if case.get("on_policy") else old_dit).state_dict())
    old = ShadowWeights.of(eng.chunks)  # θ_old = the perturbed DiT, or (on-policy) θ itself
    eng.load_diffusers_state_dict(dit.state_dict())
    ema = EMA.of(eng.chunks, 0.9)
    settings = NFTSettings(loss=NFTConfig(nft_beta=BETA, adv_clip=ADV_CLIP, kl_beta=KL), num_timesteps=num_timesteps,
                           num_minibatches=num_minibatches, micro_batch_size=micro_batch_size)
    stats = nft_update(eng, trajs, ADV, KEEP, settings, generator=torch.Generator().manual_seed(SEED), old=old,
                       ref=ref, ema=ema, device=torch.device("cpu"))
    def full_state():
        if lora is not None:
            return {k: v.clone() for k, v in eng.iter_full_adapters()}
        return eng.family.weight_map.to_diffusers({k: v.clone() for k, v in eng.iter_full_params()}, eng.config)
    state = full_state()
    with ema.applied():
        ema_state = full_state()
    out = {"state": state, "stats": stats, "ema": ema_state, "ema_updates": ema.num_updates,
           "rank": dist.get_rank(), "shadow_names": sorted(old.tensors)}
    destroy_distributed()
    return out
