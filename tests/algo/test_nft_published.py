"""DiffusionNFT as published, by default: an NFT config that leaves a field out gets the paper's value, checked
against plain transcriptions (written here) of the published training script's formulas:

- the EMA warm-up: the blend after optimizer step n (counted from 1, this step included) uses
  decay min(ema_decay, (1 + n) / (10 + n));
- θ_old ← d·θ_old + (1 − d)·θ after every iteration, d read at n = the optimizer steps so far: type 1
  d = min(0.001·n, 0.5) (the default), type 2 d = 0 for n < 75, then min(0.0075·(n − 75), 0.999);
- the KL weight 1e-4 where a reference exists (LoRA: the model with the adapters off);
- int(num_steps · 0.99) trained timesteps per sample: 9 of the sampler's 10.

Needs: CPU, 1 process (torch; megatron is imported, nothing is started). Tolerance: none for the schedules
and defaults; the EMA (a lerp here, d·ema + (1 − d)·θ as published) to 1e-6.
"""
from __future__ import annotations

import pytest
import torch

from megaflow.algo.nft import old_policy_decay
from megaflow.config import load_config
from megaflow.trainer.shadow import EMA

NFT = ['algo.name="nft"', 'rollout.sde_type="ode"']


def published_decay_type1(step: int) -> float:
    return min(0.001 * step, 0.5)


def published_decay_type2(step: int) -> float:
    return 0.0 if step < 75 else min(0.0075 * (step - 75), 0.999)


def test_defaults_of_an_nft_config_are_the_papers():
    cfg = load_config(None, NFT)
    a = cfg.algo
    assert a.nft_num_timesteps == 9 and cfg.rollout.num_steps == 10
    assert a.kl_beta == 0.0  # full-parameter training: no reference model is built for a 1e-4 KL
    assert load_config(None, [*NFT, "lora.rank=8"]).algo.kl_beta == 1e-4
    assert load_config(None, [*NFT, "rollout.num_steps=25"]).algo.nft_num_timesteps == 24  # int(25 * 0.99)
    steps = range(0, 3000)
    assert [old_policy_decay(n, rate=a.old_decay_rate, max_decay=a.old_decay_max, flat_steps=a.old_decay_flat_steps)
            for n in steps] == [published_decay_type1(n) for n in steps]
    ocr = load_config(None, [*NFT, "algo.old_decay_rate=0.0075", "algo.old_decay_max=0.999",
                             "algo.old_decay_flat_steps=75"]).algo
    assert [old_policy_decay(n, rate=ocr.old_decay_rate, max_decay=ocr.old_decay_max,
                             flat_steps=ocr.old_decay_flat_steps) for n in steps] == \
        [published_decay_type2(n) for n in steps]


def test_explicit_values_win_and_flowgrpo_keeps_its_own():
    cfg = load_config(None, [*NFT, "algo.kl_beta=0.04", "algo.nft_num_timesteps=4", "lora.rank=8"])
    assert (cfg.algo.kl_beta, cfg.algo.nft_num_timesteps) == (0.04, 4)
    assert load_config(None, ["lora.rank=8"]).algo.kl_beta == 0.04  # flowgrpo
    demo = load_config("configs/shapes_demo.toml").algo
    assert (demo.kl_beta, demo.nft_num_timesteps, demo.old_decay_max) == (0.0, 6, 0.7)


def test_ema_warm_up_counts_this_update():
    torch.manual_seed(0)
    live = torch.nn.Parameter(torch.randn(5))
    ema = EMA({"w": live}, decay=0.9)
    expected = live.detach().clone()
    for n in range(1, 120):  # past the warm-up: (1 + n) / (10 + n) reaches 0.9 at n = 80
        with torch.no_grad():
            live.add_(torch.randn(5))
        ema.step()
        d = min(0.9, (1 + n) / (10 + n))
        expected = d * expected + (1 - d) * live.detach()
        assert torch.allclose(ema.tensors["w"], expected, rtol=1e-6, atol=1e-6), n
    assert ema.num_updates == 119


class _Trainer:
    """What DiffusionNFT reads of a trainer here: its model chunks."""

    def __init__(self):
        self.chunks = [torch.nn.Linear(3, 2)]

    def schedule_lr(self, iteration: int) -> dict:
        return {}  # no schedule: the optimizer keeps its lr (Trainer.schedule_lr's answer without one)


@pytest.mark.parametrize("steps_per_iteration", [1, 6])
def test_theta_old_decay_follows_the_optimizer_step_clock(monkeypatch, steps_per_iteration):
    """θ_old's decay after iteration k is read at n = k · (optimizer steps per iteration); an iteration that
    trained nothing leaves the clock where it was."""
    import megaflow.trainer.nft as trainer_nft
    from megaflow.run.nft import DiffusionNFT
    steps = iter([steps_per_iteration, steps_per_iteration, 0, steps_per_iteration])
    monkeypatch.setattr(trainer_nft, "nft_update", lambda *a, **k: {"num_updates": float(next(steps))})
    cfg = load_config(None, [*NFT, "algo.old_decay_rate=0.03", "algo.old_decay_flat_steps=2"])
    algo = DiffusionNFT(cfg, _Trainer())
    decays = [algo.update([], torch.zeros(0), torch.zeros(0), it)["old_decay"] for it in (1, 2, 3, 4)]
    clock = [steps_per_iteration * k for k in (1, 2, 2, 3)]
    assert decays == [0.0 if n < 2 else min(0.03 * (n - 2), 0.5) for n in clock]
    assert algo.old.num_updates == clock[-1]
