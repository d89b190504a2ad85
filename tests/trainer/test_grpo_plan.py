"""GRPO training plan, microbatch assembly and loss, without a process group. Needs: CPU, 1 process.

- ``plan_updates``: flow_grpo's inner loop (epochs x minibatches, seeded shuffles; 1 x 1 = today's one step);
- ``grpo_loss`` on a microbatch whose padding rows carry NaN / ±inf: exactly the clean loss and grads;
- CFG microbatches: [uncond; cond] batch, guided velocity v_u + g·(v_c − v_u) vs plain torch (exact);
- ``dp_slice``: every DP rank the same microbatch count; full microbatches only under pipelining;
- the controller's FlowGRPO-Fast window (new every iteration, seeded), trained steps and auto clip range.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch

import megaflow  # noqa: F401
from megaflow.algo.flowgrpo import LossConfig, MismatchConfig, train_step_indices
from megaflow.config import load_config
from megaflow.run.flowgrpo import grpo_settings, train_steps
from megaflow.run.requests import make_requests, sde_window
from megaflow.flow.schedule import sd3_sigmas
from megaflow.flow.step import TransitionConfig
from megaflow.rollout.types import Trajectory
from megaflow.trainer.flowgrpo import GRPOSettings, grpo_loss
from megaflow.models.registry import get_family
from megaflow.trainer import batch
from megaflow.trainer.batch import dp_slice
from megaflow.trainer.flowgrpo_batches import guided_velocity, plan_updates, stack_items

torch.set_num_threads(1)
SD3_CONDITIONING = dict(conditioning=functools.partial(get_family("sd3").batch_conditioning, None))


def test_plan_single_step_is_sample_major_and_complete():
    assert plan_updates([0, 2, 3], [0, 1]) == [[(0, 0), (0, 1), (2, 0), (2, 1), (3, 0), (3, 1)]]
    assert plan_updates([], [0, 1]) == [] and plan_updates([1], []) == []


@pytest.mark.parametrize("pp, padded", [(1, 3), (2, 4)])
def test_dp_slice_pads_microbatches_only_under_pipelining(monkeypatch, pp, padded):
    """5 items over DP=2, micro-batches of 4: ranks take items 0, 2, 4 and 1, 3 (+1 padding item); with PP=2
    each rank fills a whole micro-batch of 4 (the stages exchange fixed shapes)."""
    items = [(i, 0) for i in range(5)]
    got = {}
    for rank in (0, 1):
        monkeypatch.setattr(batch.ps, "get_data_parallel_world_size", lambda: 2)
        monkeypatch.setattr(batch.ps, "get_data_parallel_rank", lambda r=rank: r)
        monkeypatch.setattr(batch.ps, "get_pipeline_model_parallel_world_size", lambda: pp)
        got[rank] = dp_slice(items, 4)
    mine0, real0 = got[0]
    mine1, real1 = got[1]
    assert [m for m, r in zip(mine0, real0) if r] == [(0, 0), (2, 0), (4, 0)]
    assert [m for m, r in zip(mine1, real1) if r] == [(1, 0), (3, 0)]
    assert len(mine0) == len(mine1) == len(real0) == len(real1) == padded
    assert sum(real0) + sum(real1) == 5


def test_plan_epochs_and_minibatches():
    kept, steps = [0, 1, 2, 4, 5, 6, 7], [0, 1, 2]
    plan = plan_updates(kept, steps, num_inner_epochs=2, num_minibatches=3, seed=5)
    assert len(plan) == 6 and [len(p) for p in plan] == [9, 6, 6] * 2  # 7 samples -> 3 + 2 + 2
    for epoch in (plan[:3], plan[3:]):  # every item exactly once per epoch
        assert sorted(it for p in epoch for it in p) == sorted((i, t) for i in kept for t in steps)
        assert len({i for i, _ in epoch[0]} & {i for i, _ in epoch[1]}) == 0
    first_epoch_samples = [i for p in plan[:3] for i, _ in p[::3]]
    assert first_epoch_samples != sorted(first_epoch_samples) or plan[:3] != plan[3:]  # shuffled
    assert plan == plan_updates(kept, steps, num_inner_epochs=2, num_minibatches=3, seed=5)  # seeded
    assert plan != plan_updates(kept, steps, num_inner_epochs=2, num_minibatches=3, seed=6)
    # timestep-major inside a minibatch: one timestep for all its samples, then the next
    p = plan[0]
    assert [t for _, t in p] == [t for t in dict.fromkeys(t for _, t in p) for _ in range(3)]
    assert len(plan_updates([3], steps, num_minibatches=4)) == 1  # empty minibatches are dropped
    with pytest.raises(ValueError, match="num_minibatches"):
        plan_updates(kept, steps, num_minibatches=0)
    with pytest.raises(ValueError, match="num_inner_epochs"):
        GRPOSettings(transition=TransitionConfig(), loss=LossConfig(), num_inner_epochs=0)


def _trajs(n=3, steps=4, cfg=False):
    g = torch.Generator().manual_seed(0)
    sigmas = sd3_sigmas(steps).float()
    out = []
    for i in range(n):
        cond = {"encoder_hidden_states": torch.randn(5, 8, generator=g),
                "pooled_projections": torch.randn(6, generator=g)}
        if cfg:
            cond.update(negative_encoder_hidden_states=torch.zeros(5, 8), negative_pooled_projections=torch.ones(6))
        out.append(Trajectory(request_id="r", index=i, prompt="p", seed=i, sigmas=sigmas,
                              latents=torch.randn(steps + 1, 4, 2, 2, generator=g),
                              log_probs=torch.randn(steps, generator=g), sde_mask=torch.ones(steps, dtype=torch.bool),
                              sde_type="sde", noise_level=0.7, log_prob_no_const=False,
                              guidance_scale=4.5 if cfg else 1.0, do_cfg=cfg, conditioning=cond))
    return out


@pytest.mark.parametrize("mismatch", [None, "tis"])
def test_grpo_loss_padding_rows_with_nan_add_exactly_zero(mismatch):
    trajs = _trajs()
    items, real = [(0, 0), (1, 1), (2, 2), (0, 0), (0, 0)], [True, True, True, False, False]
    settings = GRPOSettings(transition=TransitionConfig(kind="sde"), loss=LossConfig(clip_range=1e-4, kl_beta=0.04),
                            mismatch=None if mismatch is None else MismatchConfig(mismatch=mismatch))
    g = torch.Generator().manual_seed(1)
    v0 = torch.randn(5, 4, 2, 2, generator=g)
    results = []
    for poisoned in (False, True):
        mb = stack_items(trajs, torch.tensor([1.0, -0.5, 2.0]), items, real, torch.device("cpu"), **SD3_CONDITIONING)
        mb["ref_mean"] = torch.randn(5, 4, 2, 2, generator=torch.Generator().manual_seed(2))
        if poisoned:
            mb["rollout_log_prob"][3:] = torch.tensor([math.nan, -math.inf])
            mb["advantages"][3:] = torch.tensor([math.inf, math.nan])
            mb["ref_mean"][3:] = math.nan
        v = v0.clone().requires_grad_(True)
        loss, stats = grpo_loss(v, mb, settings=settings, normalizer=2.5)
        loss.backward()
        results.append((loss.detach(), v.grad, stats))
    (clean, g_clean, s_clean), (bad, g_bad, s_bad) = results
    assert torch.isfinite(bad) and torch.equal(bad, clean) and torch.equal(g_bad, g_clean)
    assert bool((g_bad[3:] == 0).all()) and s_bad["num_real"].item() == 3
    assert all(torch.equal(s_bad[k], s_clean[k]) for k in s_clean)


def test_cfg_microbatch_and_guided_velocity():
    trajs = _trajs(cfg=True)
    mb = stack_items(trajs, torch.zeros(3), [(0, 1), (2, 3)], [True, True], torch.device("cpu"), **SD3_CONDITIONING)
    assert mb["latents"].shape[0] == 4 and torch.equal(mb["latents"][:2], mb["latents"][2:])
    assert torch.equal(mb["encoder_hidden_states"][:2], torch.zeros(2, 5, 8))  # unconditional first
    assert torch.equal(mb["encoder_hidden_states"][2], trajs[0].conditioning["encoder_hidden_states"])
    assert mb["sigma"].shape == (4,) and mb["x_next"].shape[0] == 2
    out = torch.randn(4, 4, 2, 2)
    assert torch.equal(guided_velocity(out, mb), out[:2] + 4.5 * (out[2:] - out[:2]))
    no_neg = [dataclasses.replace(t, conditioning={k: v for k, v in t.conditioning.items() if "negative" not in k})
              for t in trajs]
    with pytest.raises(ValueError, match="negative_encoder_hidden_states"):
        stack_items(no_neg, torch.zeros(3), [(0, 1)], [True], torch.device("cpu"), **SD3_CONDITIONING)
    mixed = [trajs[0], _trajs(1)[0]]
    with pytest.raises(ValueError, match="mixes CFG"):
        stack_items(mixed, torch.zeros(2), [(0, 1), (1, 1)], [True, True], torch.device("cpu"), **SD3_CONDITIONING)


def test_timestep_fraction():
    sde = TransitionConfig(kind="sde")
    assert train_step_indices(10, sde, timestep_fraction=0.99) == list(range(9))  # flow_grpo: int(10*0.99)
    assert train_step_indices(4, sde, timestep_fraction=0.5) == [0, 1]
    assert train_step_indices(4, sde, [2, 3], timestep_fraction=0.5) == [2, 3]  # a window ignores it
    with pytest.raises(ValueError, match="no trainable step"):
        train_step_indices(1, sde, timestep_fraction=0.99)
    with pytest.raises(ValueError, match="timestep_fraction"):
        train_step_indices(4, sde, timestep_fraction=0.0)


def test_fast_window_drawn_every_iteration_and_trained():
    cfg = load_config(None, ["rollout.num_steps=10", "rollout.sde_window_size=3", "rollout.sde_window_range=[1, 8]"])
    windows = [sde_window(cfg, it) for it in range(1, 21)]
    assert all(len(w) == 3 and w == list(range(w[0], w[0] + 3)) and 1 <= w[0] <= 5 for w in windows)
    assert len({w[0] for w in windows}) > 2  # anew every iteration
    assert windows == [sde_window(cfg, it) for it in range(1, 21)]  # seeded: every rank draws the same
    reqs = make_requests(cfg, iter(["a", "b", "c", "d"]), 7)
    assert all(r.sde_step_indices == windows[6] for r in reqs)
    settings = grpo_settings(cfg)
    assert train_steps(cfg, settings.transition, 7) == windows[6]
    assert settings.loss.clip_range == 1e-5  # auto: a window
    other = load_config(None, ["run.seed=99", "rollout.num_steps=10", "rollout.sde_window_size=3"])
    assert [sde_window(other, it) for it in range(1, 21)] != windows


@pytest.mark.parametrize("overrides, clip", [
    ([], 1e-4), (["rollout.sde_type=\"cps\"", "rollout.log_prob_no_const=true"], 1e-5),
    (["rollout.sde_window=[0, 1]"], 1e-5), (["algo.clip_range=0.003"], 0.003),
])
def test_clip_range_auto_follows_transition(overrides, clip):
    s = grpo_settings(load_config(None, overrides + ["train.num_inner_epochs=2", "train.num_minibatches=3"]))
    assert s.loss.clip_range == clip and s.num_inner_epochs == 2 and s.num_minibatches == 3


@pytest.mark.parametrize("overrides, needle", [
    (["rollout.sde_window_size=2", "rollout.sde_window=[1]"], "set one of them"),
    (["rollout.sde_window_range=[0, 2]"], "needs rollout.sde_window_size > 0"),
    (["rollout.sde_window_size=20"], "rollout.sde_window_size = 20"),
    (["rollout.sde_window_size=2", "rollout.sde_window_range=[3]"], "expected [lo, hi]"),
    (["rollout.sde_type=\"cps\"", "rollout.log_prob_no_const=true", "rollout.sde_window_size=1"], "last step alone"),
])
def test_window_config_mistakes_name_the_value(overrides, needle):
    with pytest.raises(ValueError) as ei:
        grpo_settings(load_config(None, overrides))
    assert needle in str(ei.value)
