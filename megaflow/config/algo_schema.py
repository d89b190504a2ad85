"""The ``[algo]`` section: which algorithm runs and its objective's fields (``<algorithm>_*`` read by that
algorithm only; per-algorithm defaults in megaflow.config.algo_defaults).
"""
from __future__ import annotations

from dataclasses import dataclass

from megaflow.config.fields import MAX_ITERS, MAX_STEPS, opt


@dataclass(kw_only=True)
class AlgoConfig:
    name: str = opt("flowgrpo", "The RL algorithm. flowgrpo: SDE rollouts with per-step log-probs, PPO-clip on the "
                    "trainer's recomputed log-probs (flow_grpo). nft: DiffusionNFT, ODE rollouts (rollout.sde_type = "
                    "ode) of a soft-updated sampling policy, trained on the forward (noising) process of the clean "
                    "samples with implicit positive / negative policies. awm: Advantage Weighted Matching, ODE "
                    "rollouts of theta, the advantage-weighted flow-matching loss with a KL to a fast EMA. dgpo: "
                    "Direct Group Preference Optimization, ODE rollouts of theta, a group-level DPO against the fast "
                    "EMA (docs/algorithms/).", choices=("flowgrpo", "nft", "awm", "dgpo"))
    nft_beta: float = opt(1.0, "nft: beta, how far the implicit policies b*v + (1-b)*v_old and (1+b)*v_old - b*v "
                          "reach from the sampling policy.", gt=0.0)
    nft_num_timesteps: int = opt(9, "nft: timesteps of the sampler's grid trained per sample (drawn without "
                                 "replacement, fresh noise each). Left out: int(rollout.num_steps * "
                                 "algo.timestep_fraction), the published 9 of 10 (megaflow.config.algo_defaults).",
                                 ge=1, le=MAX_STEPS)
    old_decay_rate: float = opt(0.001, "nft: the sampling policy theta_old <- d*theta_old + (1-d)*theta after every "
                                "iteration, with d = min(old_decay_rate * (n - old_decay_flat_steps), old_decay_max), "
                                "n = optimizer steps so far (this iteration's included), d = 0 while n < "
                                "old_decay_flat_steps; 0 keeps theta_old = theta (on-policy). The paper's: 0.001 "
                                "(max 0.5), and 0.0075 (max 0.999, 75 flat steps) for OCR. awm / dgpo: the same "
                                "blend of their fast EMA (awm's KL target, dgpo's reference) without flat steps, d = "
                                "min(old_decay_rate * n, old_decay_max), the authors' 0.001 (max 0.3).", ge=0.0)
    old_decay_max: float = opt(0.5, "nft: the largest decay d of theta_old (see old_decay_rate); awm / dgpo: of the "
                               "fast EMA. Left out: nft 0.5, awm / dgpo 0.3 (the authors').", ge=0.0, lt=1.0)
    old_decay_flat_steps: int = opt(0, "nft: optimizer steps during which theta_old = theta (d = 0) before "
                                    "old_decay_rate's ramp starts (see old_decay_rate).", ge=0, le=MAX_ITERS)
    clip_range: float = opt(0.0, "PPO clip epsilon on the per-step ratio; 0 = auto as flow_grpo: 1e-4 for SDE, "
                            "1e-5 for CPS or with an SDE window (rollout.sde_window / sde_window_size).",
                            ge=0.0, lt=1.0)
    timestep_fraction: float = opt(0.99, "flowgrpo without an SDE window: train steps t < int(num_steps * "
                                   "fraction) (flow_grpo: 0.99 leaves the last step out); not used with a window. "
                                   "nft: sets the default of nft_num_timesteps. awm: trained grid indices lie in "
                                   "[1, int(num_steps * fraction)] (left out: 0.9, the authors').", gt=0.0, le=1.0)
    kl_beta: float = opt(0.04, "Weight of the KL penalty to the reference model (0 = off). flowgrpo: the KL of "
                         "the step Gaussians; nft, awm, dgpo: mean((v - v_ref)^2) of the velocities. Left out: "
                         "flowgrpo 0.04; with LoRA, where the reference is the model with the adapters off, nft "
                         "1e-4 (the paper's), awm and dgpo 1e-3 (the authors' GenEval / EMA-reference configs); "
                         "without LoRA nft, awm and dgpo 0 (no second model is built for it).", ge=0.0)
    adv_clip: float = opt(5.0, "Advantages are clipped to [-adv_clip, adv_clip]. nft: also the optimality "
                          "probability r = clip(0.5 + A / (2 adv_clip), 0, 1) and the loss scale; a smaller value puts "
                          "the loss optimum further from theta_old (toward good samples, away from bad ones). awm: "
                          "A' = clip(A) / adv_clip * awm_advantage_max.", gt=0.0)
    std_mode: str = opt("batch", "Advantage std over the whole batch (flow_grpo) or per group. Left out: dgpo "
                        "group (the authors' GenEval), the others batch.", choices=("batch", "group"))
    filter_zero_std: bool = opt(True, "Drop groups whose rewards have zero std. Left out: awm and dgpo false (their "
                                "authors keep such groups, with advantage 0), the others true.")
    awm_num_timesteps: int = opt(6, "awm: grid timesteps trained per sample, one uniform draw in each of this many "
                                 "strata of [1, int(rollout.num_steps * algo.timestep_fraction)] (fresh noise each). "
                                 "Left out: min(6, that top - 1), the authors' 6 of 14.", ge=1, le=MAX_STEPS)
    awm_weighting: str = opt("ghuber", "awm: W(l, t) of the matching error l: uniform l, t t*l, t2 t^2*l, huber "
                             "t*(sqrt(l + d) - sqrt(d)), ghuber t*((l + d)^p - d^p)/p (d = 1e-10).",
                             choices=("uniform", "t", "t2", "huber", "ghuber"))
    awm_ghuber_power: float = opt(0.25, "awm: p of the ghuber weighting (the authors' 0.25).", gt=0.0)
    awm_advantage_max: float = opt(1.0, "awm: the clipped advantage is rescaled to A' = clip(A) / adv_clip * this.",
                                   gt=0.0)
    awm_clip_range: float = opt(1.0, "awm: PPO clip epsilon of exp(logp - logp_old), logp = -W; acts only when a "
                                "rollout batch makes more than one optimizer step (train.num_minibatches, "
                                "num_inner_epochs), with logp_old from the weights before the first.", gt=0.0)
    awm_ema_kl_beta: float = opt(1.0, "awm: weight of mean((v - v_ema)^2), the KL to the fast EMA (old_decay_rate); "
                                 "0 = off (the authors warn that AWM collapses without it).", ge=0.0)
    dgpo_beta: float = opt(2000.0, "dgpo: beta of the group preference s_g = (beta / G) * sum A_i * (l_i - l_ref,i), "
                           "l_ref the fast EMA's error (the authors' CFG-free EMA-reference recipe).", gt=0.0)
    dgpo_clip_range: float = opt(1e-5, "dgpo: an item stops pulling once exp(l_ema - l) leaves 1 +- this in its "
                                 "advantage's direction; 0 = no clip.", ge=0.0)
    dgpo_num_timesteps: int = opt(4, "dgpo: grid timesteps trained, drawn without replacement from 0 .. "
                                  "dgpo_trunc_steps once per rollout batch, shared by every sample. Left out: "
                                  "min(4, dgpo_trunc_steps + 1).", ge=1, le=MAX_STEPS)
    dgpo_trunc_steps: int = opt(4, "dgpo: the last grid index drawn (the noisy end). Left out: min(4, "
                                "rollout.num_steps - 1), the authors' 4 of 10.", ge=0, le=MAX_STEPS)
    mismatch: str = opt("none", "Train/rollout mismatch correction: none, tis or mis.", choices=("none", "tis", "mis"))
    mismatch_level: str = opt("step", "Mismatch weight level: step, trajectory or geometric.",
                              choices=("step", "trajectory", "geometric"))
    mismatch_cap: float = opt(2.0, "Upper bound C of the importance weight.", gt=0.0)
    mismatch_floor: float = opt(0.0, "Lower bound of the importance weight (MIS masks below it).", ge=0.0)
