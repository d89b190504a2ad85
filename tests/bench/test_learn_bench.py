"""``megaflow bench learn``: the plain torch FlowGRPO step is megaflow's algorithm, and the plain loop runs.

Needs: CPU; a gloo world of 1 (run_multiprocess) for the megatron side; diffusers. The case is
tests/trainer/grpo_workers.py's: 7 SDE trajectories of 4 steps from a tiny SD3 DiT, one sample dropped
(keep=False), timestep_fraction 0.99 -> 18 (sample, step) items, β = 0.04 against a perturbed reference.

The engine test checks the baseline side's rollouts condition on what SGLang's do (prompts padded to
``max_sequence_length`` for every text encoder).

Tolerances (relative L2 over all parameter grads of one optimizer step):
- plain step (diffusers DiT, chunks of 5: 5+5+5+3) vs megaflow's trainer (megatron Trainer, same
  weights, ``grpo_update`` with microbatches 16+2): <= 1e-5, CFG-free and with CFG 4.5;
- plain step vs the flow_grpo transcription of grpo_workers (same diffusers forward): <= 2e-6.
"""
from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import pytest
import torch

import megaflow  # noqa: F401
from megaflow.bench.plain import plain_backward
from megaflow.flow.step import sigma_max_of, transition_log_prob
from megaflow.testing.dist import run_multiprocess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
import grpo_workers as W  # noqa: E402

ADV = torch.tensor([1.5, -0.5, 0.25, -2.0, 0.75, -1.0, 0.0])
KEEP = torch.tensor([True] * 6 + [False])


def _rel(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).double().pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / den) ** 0.5


def _params(d: dict) -> dict:
    return {k: v for k, v in d.items() if not k.endswith("pos_embed")}  # a buffer: no grad


def megatron_grads_rank(guidances: list[float]) -> dict:
    """megaflow's trainer: one ``grpo_update`` (SGD, no clip) per guidance; grads in diffusers names."""
    from megaflow.parallel.dims import ParallelDims
    from megaflow.parallel.distributed import destroy_distributed, init_distributed
    from megaflow.trainer.flowgrpo import grpo_update

    init_distributed(ParallelDims(), seed=0)
    out = {}
    for g in guidances:
        dit, trajs = W.sample_case(7, seed=3, guidance=g)
        state = {k: v.detach().clone() for k, v in dit.state_dict().items()}
        eng, ref = W._engine(W.dit_config(), optimizer=True, lr=1e-3), W._engine(W.dit_config(), optimizer=False, lr=0)
        eng.load_diffusers_state_dict(state)
        ref.load_diffusers_state_dict(W._perturbed(state, 9))
        stats = grpo_update(eng, trajs, ADV, KEEP, W.train_steps(), W._settings(mbs=16, beta=0.04), ref,
                            device=torch.device("cpu"))
        out[g] = {"grads": W._grads(eng), "num_items": stats["num_items"]}
    destroy_distributed()
    return out


def _plain_grads(guidance: float) -> dict:
    from megaflow.trainer.flowgrpo_batches import plan_updates
    dit, trajs = W.sample_case(7, seed=3, guidance=guidance)
    ref = copy.deepcopy(dit)
    ref.load_state_dict(W._perturbed(dit.state_dict(), 9))
    (items,) = plan_updates([i for i in range(7) if KEEP[i]], W.train_steps())
    assert len(items) == 18
    stats = plain_backward(dit, trajs, ADV, items, W._settings(mbs=5, beta=0.04), ref=ref, micro_batch_size=5)
    assert stats["kl"] > 0 and stats["clip_frac"] == 0.0  # first step: the sampling policy itself
    return {k: p.grad.detach().clone() for k, p in dit.named_parameters()}


@pytest.mark.dist
def test_plain_step_gradient_equals_megaflow_trainer():
    torch.set_num_threads(1)
    (megatron,) = run_multiprocess(megatron_grads_rank, 1, [1.0, 4.5], timeout_s=600)
    for g in (1.0, 4.5):
        plain = _plain_grads(g)
        assert megatron[g]["num_items"] == 18
        assert _rel(plain, _params(megatron[g]["grads"])) <= 1e-5, g
    assert _rel(_plain_grads(1.0), _params(W.reference_grads())) <= 2e-6


@pytest.mark.slow
@pytest.mark.parametrize("algo", [[], ["algo.name='nft'", "rollout.sde_type='ode'", "algo.nft_num_timesteps=2",
                                      "train.ema_decay=0.9", "algo.old_decay_rate=0.3"]], ids=["flowgrpo", "nft"])
def test_bench_learn_baseline_runs_and_trains(tmp_path, algo):
    """The baseline side, 2 iterations on a tiny SD3 (made for the run) with prompts padded to 8 tokens
    for every encoder (the SGLang-style encoding path of DiffusersEngine), for both algorithms."""
    from megaflow.bench.learn import bench_learn
    from megaflow.config import load_config
    torch.set_num_threads(1)
    cfg = load_config(None, [f"run.output_dir='{tmp_path}'", "run.name='t'", "run.seed=0", "train.iterations=2",
                             "rollout.group_size=3", "rollout.prompts_per_iter=2", "rollout.num_steps=3",
                             "rollout.height=32", "rollout.width=32", "rollout.max_sequence_length=8",
                             "train.micro_batch_size=4", "train.lr=1e-3", "eval.num=4", "eval.num_seen=2", *algo])
    out = bench_learn(cfg, side="baseline", eval_every=1, eval_num=3, target_gain=0.0)
    json.dumps(out)
    assert set(out["sides"]) == {"baseline"} and out["recipe"]["iterations"] == 2
    b = out["sides"]["baseline"]
    assert len(b["reward_per_iteration"]) == 2 and all(math.isfinite(r) for r in b["reward_per_iteration"])
    assert b["param_delta_l2"] > 0, "the plain step must change the weights"
    assert b["before"]["num"] == b["after"]["num"] == 4
    assert b["gain"] == b["after"]["accuracy"] - b["before"]["accuracy"]
    assert [p["iteration"] for p in b["curve"]] == [0, 1, 2]
    assert b["curve"][0]["rl_s"] < 1.0 and b["curve"][-1]["rl_s"] == pytest.approx(b["rl_wall_s"], abs=1e-2)
    assert b["s_per_iteration"] == pytest.approx(b["rl_wall_s"] / 2) and b["time_to_target_gain_s"] is not None
    assert (tmp_path / "t-learn-baseline" / "eval_after" / "manifest.jsonl").is_file()


@pytest.mark.slow
@pytest.mark.engine
def test_baseline_engine_conditions_and_scores_like_sglang(tiny_sd3_dir):
    """With a prompt length, DiffusersEngine encodes prompts as the SGLang engine does (every encoder padded
    to it; equal to fp32 rounding, <= 1e-5), and its DiT recomputes the engine's SDE log-probs (<= 1e-5)."""
    from megaflow.flow.step import TransitionConfig
    from megaflow.rollout.baseline import DiffusersEngine
    from megaflow.rollout.sglang import SGLangEngine, SGLangEngineConfig
    from megaflow.rollout.types import RolloutRequest
    torch.set_num_threads(1)
    reqs = [RolloutRequest(prompt=p, num_outputs=2, seed=3 + 7 * i, num_steps=3, height=32, width=32,
                           max_sequence_length=8) for i, p in enumerate(["a red circle", "two blue squares"])]
    base = DiffusersEngine.from_pretrained(str(tiny_sd3_dir))
    engine = SGLangEngine(SGLangEngineConfig(model_path=str(tiny_sd3_dir)))
    try:
        ours, theirs = base.generate(reqs), engine.generate(reqs)
    finally:
        engine.shutdown()
    cfg = TransitionConfig(kind="sde", noise_level=0.7)
    for a, b in zip(ours, theirs):
        assert a.conditioning["encoder_hidden_states"].shape[0] == 2 * 8
        for k in ("encoder_hidden_states", "pooled_projections"):
            torch.testing.assert_close(a.conditioning[k], b.conditioning[k], rtol=1e-5, atol=1e-5)
        x, n = b.latents[:-1], b.num_steps
        cond = {k: v.expand(n, *v.shape) for k, v in a.conditioning.items()}
        with torch.no_grad():
            v = base.transformer(hidden_states=x, timestep=b.sigmas[:-1] * 1000, return_dict=False,
                                 encoder_hidden_states=cond["encoder_hidden_states"],
                                 pooled_projections=cond["pooled_projections"])[0]
        lp = transition_log_prob(x, v, b.latents[1:], b.sigmas[:-1], b.sigmas[1:],
                                 sigma_max=sigma_max_of(b.sigmas), config=cfg).log_prob
        torch.testing.assert_close(lp, b.log_probs, rtol=0, atol=1e-5)
