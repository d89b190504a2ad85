"""Mismatch correction through ``grpo_update`` when a sample's trained steps fall in different microbatches.
Needs: CPU, 1 process (a fake engine with a 2-parameter velocity; megatron's parallel_state is stubbed to
one rank, the loss path is the trainer's own).

The trajectory and geometric levels weigh a sample by ALL its trained steps, so the trainer computes the
weights before microbatching. Checked: the loss and the gradient at micro_batch_size 6 (12 items = 2
microbatches, sample 1's steps split across them) equal those at one microbatch and a plain-torch
transcription of the objective (tolerance rtol 1e-5, fp32), for every level; the levels give different
gradients on this batch.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import megaflow  # noqa: F401
from megaflow.algo.flowgrpo import LossConfig, MismatchConfig
from megaflow.flow.schedule import sd3_sigmas
from megaflow.flow.step import TransitionConfig, sigma_max_of, transition_log_prob
from megaflow.models.registry import get_family
from megaflow.rollout.types import Trajectory
from megaflow.trainer import batch, flowgrpo_batches
from megaflow.trainer import flowgrpo
from megaflow.trainer.flowgrpo import GRPOSettings, grpo_update

torch.set_num_threads(1)
STEPS, CAP = 4, 1.5
TRANSITION = TransitionConfig(kind="sde", noise_level=0.7)
ADV = torch.tensor([1.0, -0.7, 0.4])


class FakeEngine:
    """v = a·x + b; megatron's contract: forward_backward scales each microbatch loss by 1/M."""

    def __init__(self):
        self.a = torch.nn.Parameter(torch.tensor(0.3))
        self.b = torch.nn.Parameter(torch.tensor(-0.2))
        self.config = SimpleNamespace(calculate_per_token_loss=False)
        self.family = get_family("sd3")  # its batch_conditioning stacks the trajectories' conditioning
        self.losses: list[float] = []
        self.optimizer = SimpleNamespace(zero_grad=self._zero, step=lambda: (True, 1.0, None))

    def _zero(self):
        self.a.grad = self.b.grad = None
        self.losses = []

    def velocity(self, x):
        return self.a * x + self.b

    def forward_backward(self, mbs, loss_fn, forward_only=False):
        if forward_only:
            with torch.no_grad():
                return [self.velocity(mb["latents"]) for mb in mbs]
        out = []
        for mb in mbs:
            loss, stats = loss_fn(self.velocity(mb["latents"]), mb)
            (loss / len(mbs)).backward()
            self.losses.append(float(loss.detach()) / len(mbs))
            out.append(stats)
        return out


def _trajs(engine):
    g = torch.Generator().manual_seed(0)
    sigmas = sd3_sigmas(STEPS).float()
    out = []
    for i in range(3):
        lat = torch.randn(STEPS + 1, 4, 2, 2, generator=g)
        with torch.no_grad():  # rollout log-probs = the trainer's own, shifted by a per-step mismatch
            lp = torch.stack([transition_log_prob(lat[t][None], engine.velocity(lat[t][None]), lat[t + 1][None],
                                                  sigmas[t], sigmas[t + 1], sigma_max=sigma_max_of(sigmas),
                                                  config=TRANSITION).log_prob[0] for t in range(STEPS)])
        lp = lp - 0.3 * torch.randn(STEPS, generator=g)
        out.append(Trajectory(request_id="r", index=i, prompt="p", seed=i, sigmas=sigmas, latents=lat, log_probs=lp,
                              sde_mask=torch.ones(STEPS, dtype=torch.bool), sde_type="sde", noise_level=0.7,
                              log_prob_no_const=False, guidance_scale=1.0, do_cfg=False,
                              conditioning={"encoder_hidden_states": torch.zeros(2, 3),
                                            "pooled_projections": torch.zeros(3)}))
    return out


def reference(engine, trajs, level):
    """(loss, grad a, grad b) of (1/N) Σ_{i,t} w·max(−Aρ, −A·clip(ρ)) written out; TIS with cap CAP."""
    total, n = 0.0, 3 * STEPS
    old = {}
    for i, tr in enumerate(trajs):
        for t in range(STEPS):
            old[i, t] = transition_log_prob(tr.latents[t][None], engine.velocity(tr.latents[t][None]).detach(),
                                            tr.latents[t + 1][None], tr.sigmas[t], tr.sigmas[t + 1],
                                            sigma_max=sigma_max_of(tr.sigmas), config=TRANSITION).log_prob[0]
    for i, tr in enumerate(trajs):
        r = [float(old[i, t]) - float(tr.log_probs[t]) for t in range(STEPS)]
        for t in range(STEPS):
            w = {"step": math.exp(r[t]), "trajectory": math.exp(sum(r)), "geometric": math.exp(sum(r) / STEPS)}[level]
            w = min(w, CAP)
            lp = transition_log_prob(tr.latents[t][None], engine.velocity(tr.latents[t][None]), tr.latents[t + 1][None],
                                     tr.sigmas[t], tr.sigmas[t + 1], sigma_max=sigma_max_of(tr.sigmas),
                                     config=TRANSITION).log_prob[0]
            ratio = torch.exp(lp - old[i, t])
            a = ADV[i]
            total = total + w * torch.maximum(-a * ratio, -a * ratio.clamp(1 - 1e-4, 1 + 1e-4)) / n
    ga, gb = torch.autograd.grad(total, [engine.a, engine.b])
    return float(total), float(ga), float(gb)


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    ps = SimpleNamespace(get_data_parallel_world_size=lambda: 1, get_data_parallel_rank=lambda: 0,
                         get_pipeline_model_parallel_world_size=lambda: 1)
    monkeypatch.setattr(flowgrpo, "ps", ps)
    monkeypatch.setattr(batch, "ps", ps)


def _update(level, micro_batch_size):
    engine = FakeEngine()
    trajs = _trajs(engine)
    settings = GRPOSettings(transition=TRANSITION, loss=LossConfig(clip_range=1e-4, kl_beta=0.0),
                            mismatch=MismatchConfig(mismatch="tis", mismatch_level=level, mismatch_cap=CAP),
                            micro_batch_size=micro_batch_size)
    stats = grpo_update(engine, trajs, ADV, torch.ones(3, dtype=torch.bool), list(range(STEPS)), settings,
                        device=torch.device("cpu"))
    return engine, trajs, stats


@pytest.mark.parametrize("level", ["step", "trajectory", "geometric"])
def test_two_microbatches_equal_one_and_the_plain_objective(level):
    split, trajs, stats = _update(level, micro_batch_size=6)
    assert stats["num_microbatches"] == 2
    whole, _, _ = _update(level, micro_batch_size=12)
    ref = reference(FakeEngine(), trajs, level)
    got = (sum(split.losses), float(split.a.grad), float(split.b.grad))
    assert got == pytest.approx(ref, rel=1e-5)
    assert got == pytest.approx((sum(whole.losses), float(whole.a.grad), float(whole.b.grad)), rel=1e-5)
    assert 0 < stats["is_weight_mean"] <= CAP


def test_levels_give_different_updates():
    grads = {level: float(_update(level, 6)[0].a.grad) for level in ("step", "trajectory", "geometric")}
    assert len({round(g, 6) for g in grads.values()}) == 3, grads


def test_loss_refuses_sample_levels_without_precomputed_weights():
    engine = FakeEngine()
    trajs = _trajs(engine)
    settings = GRPOSettings(transition=TRANSITION, loss=LossConfig(kl_beta=0.0),
                            mismatch=MismatchConfig(mismatch_level="trajectory"))
    mb = flowgrpo_batches.stack_items(trajs, ADV, [(0, 0), (0, 1)], [True, True], torch.device("cpu"),
                                      conditioning=batch.batch_conditioning(engine))
    with pytest.raises(ValueError, match="grpo_update"):
        flowgrpo.grpo_loss(engine.velocity(mb["latents"]), mb, settings=settings, normalizer=2.0)
