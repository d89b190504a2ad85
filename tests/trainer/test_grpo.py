"""FlowGRPO step in the megatron trainer. Needs: CPU, gloo world of 1 (a fresh process per launch).

Trajectories are sampled with the diffusers DiT and megaflow's flow math (the same numbers the
engine produces, see tests/rollout for engine parity); the megatron trainer, loaded with the same
weights, must recompute the rollout log-probs (<= 1e-5 abs) and one GRPO step must raise the
log-probability of the positively-advantaged sample and lower the negative one."""
import pytest

from megaflow.testing.dist import run_multiprocess

DCFG = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=16, out_channels=4,
            pos_embed_max_size=8)


def _sample(dit, num, steps, seed, kind="sde"):
    import torch

    from megaflow.flow.schedule import sd3_sigmas
    from megaflow.flow.step import TransitionConfig, sigma_max_of, step
    from megaflow.rollout.types import Trajectory
    g = torch.Generator().manual_seed(seed)
    sigmas = sd3_sigmas(steps, shift=3.0).float()
    cfg = TransitionConfig(kind=kind, noise_level=0.7, no_const=kind == "cps")
    ehs, pooled = torch.randn(num, 6, 32, generator=g), torch.randn(num, 16, generator=g)
    x = torch.randn(num, 4, 8, 8, generator=g)
    lat, lps = [x], []
    with torch.no_grad():
        for t in range(steps):
            v = dit(hidden_states=x, timestep=sigmas[t].expand(num) * 1000, encoder_hidden_states=ehs,
                    pooled_projections=pooled).sample
            r = step(x, v, sigmas[t], sigmas[t + 1], sigma_max=sigma_max_of(sigmas), config=cfg,
                     noise=torch.randn(x.shape, generator=g))
            x = r.sample
            lat.append(x)
            lps.append(r.log_prob)
    lat, lps = torch.stack(lat, 1), torch.stack(lps, 1)
    return [Trajectory(request_id="g0", index=i, prompt="p", seed=seed + i, latents=lat[i], sigmas=sigmas,
                       log_probs=lps[i], sde_mask=torch.ones(steps, dtype=torch.bool), sde_type=kind,
                       noise_level=0.7, log_prob_no_const=kind == "cps", guidance_scale=1.0, do_cfg=False,
                       conditioning={"encoder_hidden_states": ehs[i], "pooled_projections": pooled[i]})
            for i in range(num)]


def _grpo_rank(kind):
    import torch
    from diffusers import SD3Transformer2DModel

    import megaflow  # noqa: F401
    from megaflow.algo.flowgrpo import LossConfig, MismatchConfig, train_step_indices
    from megaflow.flow.step import TransitionConfig
    from megaflow.models.sd3 import from_diffusers
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import init_distributed
    from megaflow.trainer.runner import Trainer, adam_config
    from megaflow.trainer.flowgrpo import GRPOSettings, build_microbatches, grpo_train_step

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dit = SD3Transformer2DModel(**DCFG).eval()
    trajs = _sample(dit, 4, 4, seed=7, kind=kind)
    init_distributed(ParallelDims())
    eng = Trainer(from_diffusers(DCFG), spec="local",
                  optimizer_config=adam_config(lr=2e-4, grad_clip=0.0, distributed=False))
    eng.load_diffusers_state_dict(dit.state_dict())
    transition = TransitionConfig(kind=kind, noise_level=0.7, no_const=kind == "cps")
    steps = train_step_indices(4, transition)
    adv = torch.tensor([1.0, -1.0, 0.0, 0.0])
    keep = torch.tensor([True, True, True, False])
    settings = GRPOSettings(transition=transition, loss=LossConfig(clip_range=1e-4, kl_beta=0.0),
                            mismatch=MismatchConfig(mismatch="tis", mismatch_cap=2.0), micro_batch_size=3)

    def logp_sums():
        from megaflow.flow.step import transition_log_prob
        out = []
        for tr in trajs[:2]:
            total = 0.0
            for t in steps:
                v = eng.velocity(tr.latents[t][None], tr.sigmas[t][None], tr.conditioning["encoder_hidden_states"][None],
                                 tr.conditioning["pooled_projections"][None])
                total += float(transition_log_prob(tr.latents[t][None], v, tr.latents[t + 1][None], tr.sigmas[t],
                                                   tr.sigmas[t + 1], sigma_max=tr.sigmas[1], config=transition).log_prob)
            out.append(total)
        return out

    mbs = build_microbatches(eng, trajs, adv, keep, steps, settings.micro_batch_size, torch.device("cpu"))
    before = logp_sums()
    stats = grpo_train_step(eng, mbs, settings)
    after = logp_sums()
    return {"stats": stats, "before": before, "after": after, "num_mbs": len(mbs), "num_steps": len(steps)}


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_grpo_step_recomputes_rollout_logprob_and_improves(kind):
    (r,) = run_multiprocess(_grpo_rank, 1, kind, timeout_s=300)
    s = r["stats"]
    # 3 kept samples x trainable steps, microbatches of 3 (CPS drops the deterministic last step).
    assert r["num_steps"] == (3 if kind == "cps" else 4)
    assert r["num_mbs"] == r["num_steps"]
    assert s["logp_abs_diff_rollout"] <= 1e-5, s
    assert abs(s["ratio_mean"] - 1.0) < 1e-6 and s["clip_frac"] == 0.0
    assert abs(s["is_weight_mean"] - 1.0) < 1e-4, s
    assert s["update_ok"] == 1.0 and s["grad_norm"] > 0
    assert r["after"][0] > r["before"][0], r  # advantage +1: more likely
    assert r["after"][1] < r["before"][1], r  # advantage -1: less likely
