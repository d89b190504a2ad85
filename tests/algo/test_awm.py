"""AWM loss against a plain-torch transcription of the authors' objective (written here, item by item, in
float64), value and gradient through a tiny real velocity model over a grid of weightings, clip ranges, KL
weights, advantages (zeros included) and masks; the paper's limits (θ = θ_old: advantage-weighted flow matching;
A ≡ 1, uniform weighting: plain flow matching, the pretraining loss); the timestep strata; the normalizer.
Needs: CPU, 1 process (torch only)."""
import copy
import math

import pytest
import torch

from megaflow.algo.awm import (
    AWM_EMA_DECAY_MAX,
    AWMConfig,
    awm_loss,
    awm_timestep_indices,
    kl_ema_decay,
    noised,
    weighted_matching,
)

torch.set_num_threads(1)
REL = 1e-6


def paper_weight(err, t, weighting, p):
    """W(ℓ, t) as the authors' compute_log_prob_awm writes it (the negative of their log_prob)."""
    if weighting == "uniform":
        return err
    if weighting == "t":
        return err * t
    if weighting == "t2":
        return err * t ** 2
    if weighting == "huber":
        return (torch.sqrt(err + 1e-10) - 1e-5) * t
    return (torch.pow(err + 1e-10, p) - 1e-10 ** p) * t / p


def paper_objective(v, x0, eps, t, adv, mask, *, cfg, v_old=None, v_ref=None, v_ema=None):
    """mean over kept items of max(−A'ρ, −A'·clip(ρ, 1 ± ε)) + β·KL_ref + β_ema·KL_ema, ρ = exp(logp − logp_old)."""
    total, count = 0.0, 0
    for i in range(v.shape[0]):
        if not mask[i]:
            continue
        target = eps[i].double() - x0[i].double()
        ti = float(t[i])
        logp = -paper_weight(((v[i] - target) ** 2).mean(), ti, cfg.awm_weighting, cfg.awm_ghuber_power)
        if v_old is None:
            old = logp.detach()
        else:
            old = -paper_weight(((v_old[i].double() - target) ** 2).mean(), ti, cfg.awm_weighting,
                                cfg.awm_ghuber_power)
        a = min(cfg.adv_clip, max(-cfg.adv_clip, float(adv[i]))) / cfg.adv_clip * cfg.awm_advantage_max
        ratio = torch.exp(logp - old)
        clipped = torch.clamp(ratio, 1 - cfg.awm_clip_range, 1 + cfg.awm_clip_range)
        item = torch.maximum(-a * ratio, -a * clipped)
        if cfg.kl_beta > 0:
            item = item + cfg.kl_beta * ((v[i] - v_ref[i].double()) ** 2).mean()
        if cfg.awm_ema_kl_beta > 0:
            item = item + cfg.awm_ema_kl_beta * ((v[i] - v_ema[i].double()) ** 2).mean()
        total, count = total + item, count + 1
    return total / max(count, 1)


class TinyVelocity(torch.nn.Module):
    """A real (if small) velocity model: v(x, t) = conv(x) + t·b."""

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        with torch.no_grad():
            for p in self.conv.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        self.b = torch.nn.Parameter(torch.randn(4, 1, 1, generator=g))

    def forward(self, x, t):
        return self.conv(x) + t.view(-1, 1, 1, 1) * self.b


def _old_velocity(v, x0, eps, scale=0.1):
    """A fixed old policy's velocity: v moved toward (ratio < 1) or away from (ratio > 1) the target ε − x0."""
    side = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -2.0], dtype=torch.float64).view(-1, 1, 1, 1)
    return (v + scale * side * (eps.double() - x0.double() - v)).detach()


def _batch(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(n, 4, 8, 8, generator=g)
    eps = torch.randn(n, 4, 8, 8, generator=g)
    t = torch.rand(n, generator=g) * 0.9 + 0.05
    adv = torch.tensor([2.0, -1.0, 0.0, 7.0, -6.0, 0.4])[:n]  # a zero, two beyond the clip
    return x0, eps, t, adv


def _grads(loss, model):
    return torch.autograd.grad(loss, list(model.parameters()))


def _assert_close(got, want):
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=REL, abs=1e-12)


def _assert_grads_close(got, want):
    for g, w in zip(got, want):
        assert torch.allclose(g.double(), w.double(), rtol=REL, atol=REL * float(w.abs().max())), (g, w)


GRID = [  # weighting, clip range, kl_beta, ema_kl_beta, off-policy, mask
    ("ghuber", 1.0, 3e-3, 1.0, False, None),
    ("ghuber", 1e-3, 3e-3, 1.0, True, None),
    ("ghuber", 1.0, 0.0, 0.0, True, [True, True, False, True, False, True]),
    ("uniform", 0.2, 0.5, 0.0, True, None),
    ("t", 1.0, 0.0, 2.0, False, [False, True, True, True, True, True]),
    ("t2", 1e-2, 1e-4, 0.3, True, None),
    ("huber", 0.5, 0.0, 0.0, True, [True, False, True, False, True, True]),
]


@pytest.mark.parametrize("weighting,clip,kl_beta,ema_kl_beta,off_policy,mask", GRID)
@pytest.mark.parametrize("advantage_max", [1.0, 0.5])
def test_loss_and_grad_match_the_transcription(weighting, clip, kl_beta, ema_kl_beta, off_policy, mask,
                                               advantage_max):
    x0, eps, t, adv = _batch()
    model64 = TinyVelocity(1).double()
    ref, ema = TinyVelocity(3).double(), TinyVelocity(4).double()
    xt = noised(x0.double(), eps.double(), t.double())
    cfg = AWMConfig(awm_weighting=weighting, awm_clip_range=clip, kl_beta=kl_beta, awm_ema_kl_beta=ema_kl_beta,
                    awm_advantage_max=advantage_max)
    keep = torch.ones(6, dtype=torch.bool) if mask is None else torch.tensor(mask)
    with torch.no_grad():
        v_old = _old_velocity(model64(xt, t.double()), x0, eps) if off_policy else None
        v_ref, v_ema = ref(xt, t.double()), ema(xt, t.double())
    v = model64(xt, t.double())
    loss, stats = awm_loss(v, x0, eps, t, adv, config=cfg, old_velocity=v_old, ref_velocity=v_ref,
                           ema_velocity=v_ema, mask=None if mask is None else keep)
    want = paper_objective(model64(xt, t.double()), x0, eps, t, adv, keep, cfg=cfg, v_old=v_old, v_ref=v_ref,
                           v_ema=v_ema)
    _assert_close(loss, want)
    _assert_grads_close(_grads(loss, model64), _grads(want, model64))
    assert loss.dtype == torch.float64 and all(torch.isfinite(s) for s in stats.values())
    if not off_policy:
        assert float(stats["ratio_mean"]) == 1.0 and float(stats["clip_frac"]) == 0.0


def test_float32_model_matches_the_float64_transcription():
    """The default recipe on a float32 model against the transcription on a float64 copy (test_nft's setting)."""
    x0, eps, t, adv = _batch(seed=3)
    model, ref, ema = TinyVelocity(5), TinyVelocity(6), TinyVelocity(7)
    xt = noised(x0, eps, t)
    cfg = AWMConfig()
    with torch.no_grad():
        v_ref, v_ema = ref(xt, t), ema(xt, t)
    loss, _ = awm_loss(model(xt, t), x0, eps, t, adv, config=cfg, ref_velocity=v_ref, ema_velocity=v_ema)
    model64 = copy.deepcopy(model).double()
    want = paper_objective(model64(xt.double(), t.double()), x0, eps, t, adv, torch.ones(6, dtype=torch.bool),
                           cfg=cfg, v_ref=v_ref, v_ema=v_ema)
    assert loss.dtype == torch.float32
    _assert_close(loss, want)
    _assert_grads_close(_grads(loss, model), _grads(want, model64))


@pytest.mark.parametrize("weighting", ["ghuber", "t", "uniform"])
def test_at_theta_old_the_gradient_is_advantage_weighted_matching(weighting):
    """θ = θ_old (the authors' on-policy step): ∇ loss = ∇ mean(A'·W(ℓ, t)), the paper's AWM objective, for
    any clip range; a zero-advantage batch has no policy gradient."""
    x0, eps, t, adv = _batch(seed=8)
    model = TinyVelocity(9).double()
    xt = noised(x0.double(), eps.double(), t.double())
    for clip in (1.0, 1e-4):
        cfg = AWMConfig(awm_weighting=weighting, awm_clip_range=clip, kl_beta=0.0, awm_ema_kl_beta=0.0)
        loss, _ = awm_loss(model(xt, t.double()), x0, eps, t, adv, config=cfg)
        err = ((model(xt, t.double()) - (eps.double() - x0.double())) ** 2).mean(dim=(1, 2, 3))
        awm = (adv.double().clamp(-5, 5) / 5 * paper_weight(err, t.double(), weighting, 0.25)).mean()
        _assert_grads_close(_grads(loss, model), _grads(awm, model))
    loss0, _ = awm_loss(model(xt, t.double()), x0, eps, t, torch.zeros(6), config=cfg)
    assert all(float(g.abs().max()) == 0.0 for g in _grads(loss0, model))


def test_constant_advantage_is_plain_flow_matching():
    """A' ≡ 1 with the uniform weighting: every sample weighs the same and AWM is the pretraining loss."""
    x0, eps, t, _ = _batch(seed=10)
    model = TinyVelocity(11).double()
    xt = noised(x0.double(), eps.double(), t.double())
    cfg = AWMConfig(awm_weighting="uniform", kl_beta=0.0, awm_ema_kl_beta=0.0)
    loss, _ = awm_loss(model(xt, t.double()), x0, eps, t, torch.full((6,), 5.0), config=cfg)
    flow_matching = ((model(xt, t.double()) - (eps.double() - x0.double())) ** 2).mean()
    _assert_grads_close(_grads(loss, model), _grads(flow_matching, model))


def test_weightings_hand_values_and_ghuber_power_one_is_t():
    err, t = torch.tensor([0.0, 0.25, 4.0], dtype=torch.float64), torch.tensor([0.5, 0.5, 0.25], dtype=torch.float64)
    assert weighted_matching(err, t, "uniform").tolist() == pytest.approx([0.0, 0.25, 4.0])
    assert weighted_matching(err, t, "t2").tolist() == pytest.approx([0.0, 0.0625, 0.25])
    root = [0.0, 0.5 - 1e-5, 2.0 - 1e-5]  # sqrt(ℓ + δ) − sqrt(δ), δ = 1e-10
    assert weighted_matching(err, t, "huber").tolist() == pytest.approx([0.0, 0.5 * root[1], 0.25 * root[2]], abs=1e-9)
    ghuber = weighted_matching(err, t, "ghuber", 0.5)  # t·((ℓ + δ)^½ − δ^½)/½
    assert ghuber.tolist() == pytest.approx([0.0, root[1], 0.5 * root[2]], abs=1e-9)
    assert torch.allclose(weighted_matching(err, t, "ghuber", 1.0), weighted_matching(err, t, "t"), atol=1e-15)
    with pytest.raises(ValueError, match="weighting"):
        weighted_matching(err, t, "elbo")


def test_mask_keeps_nan_out_and_normalizer_sums():
    x0, eps, t, adv = _batch(seed=12)
    model, old, ref, ema = TinyVelocity(13), TinyVelocity(14), TinyVelocity(15), TinyVelocity(16)
    xt = noised(x0, eps, t)
    with torch.no_grad():
        v_old, v_ref, v_ema = old(xt, t), ref(xt, t), ema(xt, t)
    mask = torch.tensor([True, True, False, True, False, True])
    bad = [x.clone() for x in (v_old, x0, eps, t, adv)]
    bad[0][2], bad[1][4], bad[2][2], bad[3][4], bad[4][2] = float("nan"), float("inf"), float("nan"), float("nan"), \
        float("inf")
    v = model(xt, t)
    cfg = AWMConfig(awm_clip_range=0.1)
    loss, stats = awm_loss(v, *bad[1:], config=cfg, old_velocity=bad[0], ref_velocity=v_ref, ema_velocity=v_ema,
                           mask=mask)
    keep = mask.nonzero().flatten()
    sub, _ = awm_loss(v[keep], x0[keep], eps[keep], t[keep], adv[keep], config=cfg, old_velocity=v_old[keep],
                      ref_velocity=v_ref[keep], ema_velocity=v_ema[keep])
    assert torch.isfinite(loss) and float(loss.detach()) == pytest.approx(float(sub.detach()), rel=1e-6)
    assert all(torch.isfinite(s) for s in stats.values())
    assert all(torch.isfinite(g).all() for g in _grads(loss, model))
    summed, _ = awm_loss(v, x0, eps, t, adv, config=cfg, old_velocity=v_old, ref_velocity=v_ref,
                         ema_velocity=v_ema, mask=mask, normalizer=10)
    assert float(summed.detach()) == pytest.approx(float(sub.detach()) * 4 / 10, rel=1e-6)


def test_timestep_strata_and_kl_ema_decay():
    seen = set()
    for seed in range(200):
        idx = awm_timestep_indices(14, 6, 0.9, generator=torch.Generator().manual_seed(seed))
        assert [lo <= i < hi for i, (lo, hi) in zip(idx, [(1, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)])] == \
            [True] * 6
        seen.update(idx)
    assert seen == set(range(1, 12))  # every index of every stratum is drawn, never 0, 12 or 13
    with pytest.raises(ValueError, match="num_timesteps"):
        awm_timestep_indices(4, 6, 0.9)
    assert [kl_ema_decay(s) for s in (0, 100, 300, 10_000)] == pytest.approx([0.0, 0.1, AWM_EMA_DECAY_MAX, 0.3])


def test_config_checks_and_missing_velocities():
    for bad in ({"adv_clip": 0.0}, {"awm_advantage_max": -1.0}, {"awm_ghuber_power": math.inf},
                {"awm_clip_range": 0.0}, {"kl_beta": -1e-3}, {"awm_ema_kl_beta": math.nan},
                {"awm_weighting": "ELBO"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            AWMConfig(**bad)
    x0, eps, t, adv = _batch()
    with pytest.raises(ValueError, match="ref_velocity"):
        awm_loss(x0, x0, eps, t, adv, config=AWMConfig(awm_ema_kl_beta=0.0))
    with pytest.raises(ValueError, match="ema_velocity"):
        awm_loss(x0, x0, eps, t, adv, config=AWMConfig(kl_beta=0.0))
    with pytest.raises(ValueError, match="normalizer"):
        awm_loss(x0, x0, eps, t, adv, config=AWMConfig(kl_beta=0.0, awm_ema_kl_beta=0.0), normalizer=0)
