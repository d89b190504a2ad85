"""DGPO loss against a plain-torch transcription of the paper's objective (written here, group by group, in
float64: −log σ(R(G⁺) − R(G⁻)) with advantage-weighted implicit rewards), value and gradient through a tiny
real velocity model over a grid of β, clip ranges, KL weights, advantages (zeros included) and masks; the
limits: one pair is Diffusion-DPO, β → 0 is advantage-weighted flow matching at σ(0) = ½; groups split over
calls (precomputed scores) equal one call; the normalizer. Needs: CPU, 1 process (torch only)."""
import math

import pytest
import torch

from megaflow.algo.dgpo import DGPOConfig, dgpo_group_scores, dgpo_loss, matching_error, noised

torch.set_num_threads(1)
REL = 1e-6
G = 4  # group size of the grid: 3 groups of 4


def paper_group_loss(errors, ref_errors, advantages, beta, group_size):
    """−log σ(R(G⁺) − R(G⁻)) of one group: R(G±) = Σ_{x∈G±} |A(x)|·r(x), r = −(β/G)·(ℓ_θ − ℓ_ref) (the
    diffusion implicit reward, flow-matching ELBO), G⁺ = {A > 0}, G⁻ = {A < 0}."""
    reward_pos, reward_neg = 0.0, 0.0
    for err, ref, a in zip(errors, ref_errors, advantages):
        r = -(beta / group_size) * (err - ref)
        if a > 0:
            reward_pos = reward_pos + abs(a) * r
        elif a < 0:
            reward_neg = reward_neg + abs(a) * r
    return -torch.nn.functional.logsigmoid(torch.as_tensor(reward_pos - reward_neg, dtype=torch.float64))


def paper_objective(v, v_ref, x0, eps, adv, groups, keep, *, cfg, group_size, v_old=None, v_kl=None):
    """(Σ over groups of G·(1/β)·(−log σ(R⁺ − R⁻)) + Σ over kept items of kl_beta·KL) / kept items: every
    group weighs G items whatever of it is masked out (the authors keep each member; a masked one has A = 0).
    An item whose matching ratio left the clip range in its advantage's direction enters with a detached error."""
    errors, refs, advs = {}, {}, {}
    kl_total, count = 0.0, 0
    for i in range(v.shape[0]):
        if not keep[i]:
            continue
        target = eps[i].double() - x0[i].double()
        err = ((v[i] - target) ** 2).mean()
        a = min(cfg.adv_clip, max(-cfg.adv_clip, float(adv[i])))
        if cfg.dgpo_clip_range > 0:
            ratio = math.exp(float(((v_old[i].double() - target) ** 2).mean()) - float(err.detach()))
            if (a > 0 and ratio > 1 + cfg.dgpo_clip_range) or (a <= 0 and ratio < 1 - cfg.dgpo_clip_range):
                err = err.detach()
        g = int(groups[i])
        errors.setdefault(g, []).append(err)
        refs.setdefault(g, []).append(((v_ref[i].double() - target) ** 2).mean())
        advs.setdefault(g, []).append(a)
        if cfg.kl_beta > 0:
            kl_total = kl_total + ((v[i] - v_kl[i].double()) ** 2).mean()
        count += 1
    preference = sum(group_size * paper_group_loss(errors[g], refs[g], advs[g], cfg.dgpo_beta, group_size)
                     for g in errors) / cfg.dgpo_beta
    return (preference + cfg.kl_beta * kl_total) / max(count, 1)


def diffusion_dpo(err_w, ref_w, err_l, ref_l, beta):
    """Diffusion-DPO (Wallace et al. 2023, Eq. 14), velocity errors, T·ω(λ) folded into β:
    −log σ(−β·[(ℓ_w − ℓ_ref,w) − (ℓ_l − ℓ_ref,l)])."""
    return -torch.nn.functional.logsigmoid(-beta * ((err_w - ref_w) - (err_l - ref_l)))


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


def _batch(seed=0, n=12):
    """Three groups of four (ids 7, 3, 9: any ints), one shared noise and timestep per group, as the authors."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(n, 4, 8, 8, generator=g, dtype=torch.float64)
    eps = torch.randn(n // G, 4, 8, 8, generator=g, dtype=torch.float64).repeat_interleave(G, dim=0)
    t = (torch.rand(n // G, generator=g, dtype=torch.float64) * 0.9 + 0.05).repeat_interleave(G)
    adv = torch.tensor([1.2, -0.4, 0.0, -0.8, 6.0, -2.0, -2.0, -2.0, 0.5, 0.5, -1.5, 0.5], dtype=torch.float64)[:n]
    groups = torch.tensor([7, 3, 9]).repeat_interleave(G)[:n]
    return x0, eps, t, adv, groups


def _old_velocity(v, x0, eps, scale=0.02):
    """A fixed old policy's velocity: v moved toward or away from the target, ratios on both sides of 1."""
    side = torch.tensor([1.0, -1.0, 0.5, -0.5, -1.5, 1.5, -0.3, 0.8, -0.6, 0.3, 2.0, -2.0], dtype=torch.float64)
    side = side[:v.shape[0]].view(-1, 1, 1, 1)
    return (v + scale * side * (eps - x0 - v)).detach()


def _grads(loss, model):
    return torch.autograd.grad(loss, list(model.parameters()))


def _assert_close(got, want):
    assert float(got.detach()) == pytest.approx(float(want.detach()), rel=REL, abs=1e-12)


def _assert_grads_close(got, want):
    for g, w in zip(got, want):
        assert torch.allclose(g.double(), w.double(), rtol=REL, atol=REL * float(w.abs().max())), (g, w)


def _velocities(seed, x0, eps, t):
    model, ref, kl_ref = TinyVelocity(seed).double(), TinyVelocity(seed + 1).double(), TinyVelocity(seed + 2).double()
    xt = noised(x0, eps, t)
    with torch.no_grad():
        v_ref, v_kl = ref(xt, t), kl_ref(xt, t)
    return model, xt, v_ref, v_kl


GRID = [  # β, clip range, kl_beta, mask
    (100.0, 1e-2, 0.02, None),
    (2000.0, 1e-5, 1e-3, None),
    (10.0, 0.0, 0.0, [True] * 5 + [False] + [True] * 6),
    (1.0, 5e-2, 0.5, [False, True, True, True] + [True] * 4 + [True, False, True, False]),
    (0.3, 0.0, 1e-3, None),
    (5.0, 0.12, 0.0, None),  # ratios 1.22 (A > 0) and 0.83, 0.81 (A < 0) within ε of the bound: the clip's edges
]


@pytest.mark.parametrize("beta,clip,kl_beta,mask", GRID)
@pytest.mark.parametrize("zero_adv", [False, True])
def test_loss_and_grad_match_the_transcription(beta, clip, kl_beta, mask, zero_adv):
    x0, eps, t, adv, groups = _batch()
    if zero_adv:
        adv = torch.zeros_like(adv)
    model, xt, v_ref, v_kl = _velocities(1, x0, eps, t)
    cfg = DGPOConfig(dgpo_beta=beta, dgpo_clip_range=clip, kl_beta=kl_beta)
    keep = torch.ones(12, dtype=torch.bool) if mask is None else torch.tensor(mask)
    v_old = _old_velocity(model(xt, t), x0, eps) if clip > 0 else None
    loss, stats = dgpo_loss(model(xt, t), x0, eps, adv, groups, config=cfg, group_size=G, ref_velocity=v_ref,
                            old_velocity=v_old, kl_velocity=v_kl if kl_beta > 0 else None,
                            mask=None if mask is None else keep)
    want = paper_objective(model(xt, t), v_ref, x0, eps, adv, groups, keep, cfg=cfg, group_size=G, v_old=v_old,
                           v_kl=v_kl)
    _assert_close(loss, want)
    if want.requires_grad:
        _assert_grads_close(_grads(loss, model), _grads(want, model))
    else:  # no preference and no KL: nothing pulls
        assert zero_adv and kl_beta == 0 and all(float(g.abs().max()) == 0 for g in _grads(loss, model))
    assert loss.dtype == torch.float64 and all(torch.isfinite(s) for s in stats.values())
    if zero_adv:  # no preference: σ(0) = ½ and every group's value is G·log 2 / β
        groups_kept = len(set(groups[keep].tolist()))
        assert float(stats["group_weight"]) == 0.5
        assert float(stats["policy_loss"]) == pytest.approx(groups_kept * G * math.log(2) / beta / int(keep.sum()))
    if clip > 0 and not zero_adv:
        assert 0.0 < float(stats["clip_frac"]) < 1.0  # the grid exercises both sides of the clip


@pytest.mark.parametrize("beta", [0.5, 50.0, 2000.0])
def test_one_pair_is_diffusion_dpo(beta):
    """G = 2 with advantages ±1 (a pair's group-normalised advantages): β·loss is Diffusion-DPO with β_D = β/2."""
    x0, eps, t, _, _ = _batch(seed=2, n=4)  # two pairs, one noise and one timestep (as Diffusion-DPO's pairs)
    adv, groups = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=torch.float64), torch.tensor([0, 0, 1, 1])
    model, xt, v_ref, _ = _velocities(3, x0, eps, t)
    cfg = DGPOConfig(dgpo_beta=beta, dgpo_clip_range=0.0, kl_beta=0.0)
    loss, _ = dgpo_loss(model(xt, t), x0, eps, adv, groups, config=cfg, group_size=2, ref_velocity=v_ref)
    err, ref = matching_error(model(xt, t), x0, eps), matching_error(v_ref, x0, eps)
    dpo = (diffusion_dpo(err[0], ref[0], err[1], ref[1], beta / 2) + diffusion_dpo(err[3], ref[3], err[2], ref[2],
                                                                                   beta / 2)) / 2
    _assert_close(beta * loss, dpo)
    _assert_grads_close(_grads(beta * loss, model), _grads(dpo, model))


def test_small_beta_is_advantage_weighted_flow_matching():
    """β → 0: σ(s_g) → ½, so ∇ loss → ½·∇ mean(A·ℓ), advantage-weighted flow matching (AWM, uniform weight)."""
    x0, eps, t, adv, groups = _batch(seed=4)
    model, xt, v_ref, _ = _velocities(5, x0, eps, t)
    cfg = DGPOConfig(dgpo_beta=1e-9, dgpo_clip_range=0.0, kl_beta=0.0)
    loss, _ = dgpo_loss(model(xt, t), x0, eps, adv, groups, config=cfg, group_size=G, ref_velocity=v_ref)
    awm = 0.5 * (adv.clamp(-5, 5) * matching_error(model(xt, t), x0, eps)).mean()
    _assert_grads_close(_grads(loss, model), _grads(awm, model))


def test_groups_split_over_calls_with_precomputed_scores():
    """Scores from one no-grad pass over the batch, then microbatches that cut groups: the summed losses (with
    the batch's item count as normalizer) equal one call, value and gradient."""
    x0, eps, t, adv, groups = _batch(seed=6)
    model, xt, v_ref, v_kl = _velocities(7, x0, eps, t)
    cfg = DGPOConfig(dgpo_beta=100.0, dgpo_clip_range=1e-2, kl_beta=0.02)
    v_old = _old_velocity(model(xt, t), x0, eps)
    whole, _ = dgpo_loss(model(xt, t), x0, eps, adv, groups, config=cfg, group_size=G, ref_velocity=v_ref,
                         old_velocity=v_old, kl_velocity=v_kl)
    with torch.no_grad():
        scores = dgpo_group_scores(matching_error(model(xt, t), x0, eps), matching_error(v_ref, x0, eps), adv,
                                   groups, config=cfg, group_size=G)
    parts = []
    for idx in (torch.tensor([0, 5, 9, 2, 11]), torch.tensor([1, 3, 4, 6, 7, 8, 10])):
        part, _ = dgpo_loss(model(xt[idx], t[idx]), x0[idx], eps[idx], adv[idx], groups[idx], config=cfg,
                            group_size=G, ref_velocity=v_ref[idx], old_velocity=v_old[idx], kl_velocity=v_kl[idx],
                            scores=scores.take(idx), normalizer=12)
        parts.append(part)
    _assert_close(sum(parts), whole)
    _assert_grads_close(_grads(sum(parts), model), _grads(whole, model))


def test_mask_keeps_nan_out_and_normalizer_sums():
    x0, eps, t, adv, groups = _batch(seed=8)
    model, xt, v_ref, v_kl = _velocities(9, x0, eps, t)
    model = model.float()
    cfg = DGPOConfig(dgpo_beta=100.0, dgpo_clip_range=1e-2, kl_beta=0.02)
    v = model(xt.float(), t.float())
    v_old = _old_velocity(v.double(), x0, eps).float()
    mask = torch.tensor([True, False, True, True] * 3)
    bad = [x.clone() for x in (v_ref, v_old, x0, eps, adv)]
    for tensor in bad:
        tensor[1] = float("nan")
    bad[0][5], bad[4][9] = float("inf"), float("inf")
    mask[5] = mask[9] = False
    loss, stats = dgpo_loss(v, bad[2], bad[3], bad[4], groups, config=cfg, group_size=G, ref_velocity=bad[0],
                            old_velocity=bad[1], kl_velocity=v_kl, mask=mask)
    keep = mask.nonzero().flatten()
    sub, _ = dgpo_loss(v[keep], x0[keep], eps[keep], adv[keep], groups[keep], config=cfg, group_size=G,
                       ref_velocity=v_ref[keep], old_velocity=v_old[keep], kl_velocity=v_kl[keep])
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert float(loss.detach()) == pytest.approx(float(sub.detach()), rel=1e-6)
    assert all(torch.isfinite(s) for s in stats.values())
    assert all(torch.isfinite(g).all() for g in _grads(loss, model))
    summed, _ = dgpo_loss(v, x0, eps, adv, groups, config=cfg, group_size=G, ref_velocity=v_ref, old_velocity=v_old,
                          kl_velocity=v_kl, mask=mask, normalizer=20)
    assert float(summed.detach()) == pytest.approx(float(sub.detach()) * len(keep) / 20, rel=1e-6)


def test_config_checks_and_missing_velocities():
    for bad in ({"dgpo_beta": 0.0}, {"dgpo_clip_range": -1e-3}, {"kl_beta": math.inf}, {"adv_clip": math.nan}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DGPOConfig(**bad)
    x0, eps, _, adv, groups = _batch()
    with pytest.raises(ValueError, match="old_velocity"):
        dgpo_loss(x0, x0, eps, adv, groups, config=DGPOConfig(kl_beta=0.0), group_size=G, ref_velocity=x0)
    with pytest.raises(ValueError, match="kl_velocity"):
        dgpo_loss(x0, x0, eps, adv, groups, config=DGPOConfig(dgpo_clip_range=0.0), group_size=G, ref_velocity=x0)
    with pytest.raises(ValueError, match="group_size"):
        dgpo_group_scores(adv, adv, adv, groups, config=DGPOConfig(), group_size=0)
