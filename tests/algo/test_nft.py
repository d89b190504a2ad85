"""DiffusionNFT loss against a plain-torch transcription of the paper's objective (written here, per item,
in float64), its gradient through a tiny real velocity model, the θ = θ_old reduction to advantage-weighted
flow matching, masking and the equal-weighting normalizer. Needs: CPU, 1 process (torch only).
"""
import copy

import pytest
import torch

from megaflow.algo.nft import NFTConfig, nft_loss, noised, optimality

torch.set_num_threads(1)
REL = 1e-6


def paper_objective(v, v_old, v_ref, x0, eps, t, adv, *, beta, adv_clip, kl_beta):
    """The paper's objective item by item (float64): implicit policies, x0 predictions, self-normalised
    squared errors weighted by the optimality probability, scaled by adv_clip / beta, plus the velocity KL."""
    total = 0.0
    for i in range(v.shape[0]):
        ti = float(t[i])
        xt = (1 - ti) * x0[i].double() + ti * eps[i].double()
        vp = beta * v[i].double() + (1 - beta) * v_old[i].double()
        vn = (1 + beta) * v_old[i].double() - beta * v[i].double()
        ep, en = xt - ti * vp - x0[i].double(), xt - ti * vn - x0[i].double()
        wp, wn = max(float(ep.detach().abs().mean()), 1e-5), max(float(en.detach().abs().mean()), 1e-5)
        a = max(-adv_clip, min(adv_clip, float(adv[i])))
        r = min(1.0, max(0.0, 0.5 + a / (2 * adv_clip)))
        item = adv_clip * (r * (ep ** 2).mean() / wp + (1 - r) * (en ** 2).mean() / wn) / beta
        if kl_beta > 0:
            item = item + kl_beta * ((v[i].double() - v_ref[i].double()) ** 2).mean()
        total = total + item
    return total / v.shape[0]


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


def _batch(seed=0, n=6):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(n, 4, 8, 8, generator=g)
    eps = torch.randn(n, 4, 8, 8, generator=g)
    t = torch.rand(n, generator=g) * 0.9 + 0.05
    adv = torch.tensor([2.0, -1.0, 0.0, 7.0, -6.0, 0.4])[:n]  # two beyond the clip
    return x0, eps, t, adv


@pytest.mark.parametrize("beta,kl_beta", [(1.0, 0.0), (0.3, 1e-2), (2.0, 0.5)])
def test_loss_and_grad_match_the_paper_transcription(beta, kl_beta):
    x0, eps, t, adv = _batch()
    model, old, ref = TinyVelocity(1), TinyVelocity(2), TinyVelocity(3)
    xt = noised(x0, eps, t)
    cfg = NFTConfig(nft_beta=beta, adv_clip=5.0, kl_beta=kl_beta)
    with torch.no_grad():
        v_old, v_ref = old(xt, t), ref(xt, t)
    loss, stats = nft_loss(model(xt, t), v_old, x0, xt, t, adv, config=cfg, ref_velocity=v_ref)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    model64 = copy.deepcopy(model).double()
    expected = paper_objective(model64(xt.double(), t.double()), v_old, v_ref, x0, eps, t, adv, beta=beta,
                               adv_clip=5.0, kl_beta=kl_beta)
    expected_grads = torch.autograd.grad(expected, list(model64.parameters()))
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=REL)
    for got, want in zip(grads, expected_grads):
        assert torch.allclose(got.double(), want, rtol=REL, atol=REL * float(want.abs().max())), (got, want)
    assert float(stats["optimality"]) == pytest.approx(float(optimality(adv, 5.0).mean()), rel=1e-6)
    assert float(stats["old_deviation"]) > 0


def test_at_theta_old_the_gradient_is_advantage_weighted_flow_matching():
    """θ = θ_old: ∇ℓ = ∇[clip(A, −c, c) · mean((x_t − t·v_θ − x0)²) / w], w = mean|x_t − t·v_old − x0|."""
    x0, eps, t, adv = _batch(seed=4)
    model = TinyVelocity(5)
    xt = noised(x0, eps, t)
    cfg = NFTConfig(nft_beta=0.7, adv_clip=5.0)
    with torch.no_grad():
        v_old = model(xt, t)
    loss, _ = nft_loss(model(xt, t), v_old, x0, xt, t, adv, config=cfg)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    te = t.view(-1, 1, 1, 1)
    w = (xt - te * v_old - x0).abs().mean(dim=(1, 2, 3))
    fm = ((xt - te * model(xt, t) - x0) ** 2).mean(dim=(1, 2, 3)) / w
    weighted = (adv.clamp(-5, 5) * fm).mean()
    want = torch.autograd.grad(weighted, list(model.parameters()))
    for got, exp in zip(grads, want):
        assert torch.allclose(got, exp, rtol=1e-5, atol=1e-6 * float(exp.abs().max()))
    # and a zero-advantage batch has no gradient there
    loss0, _ = nft_loss(model(xt, t), v_old, x0, xt, t, torch.zeros_like(adv), config=cfg)
    for gz in torch.autograd.grad(loss0, list(model.parameters())):
        assert float(gz.abs().max()) < 1e-6


def test_positive_samples_are_fitted_negative_ones_pushed_away():
    """One small step along −∇ℓ from θ = θ_old moves x̂0 toward a positive sample and away from a negative one."""
    x0, eps, t, _ = _batch(seed=7, n=2)
    xt = noised(x0, eps, t)
    for a, closer in ((3.0, True), (-3.0, False)):
        model = TinyVelocity(8)
        with torch.no_grad():
            v_old = model(xt, t)
        err_before = ((xt - t.view(-1, 1, 1, 1) * v_old - x0) ** 2).mean()
        loss, _ = nft_loss(model(xt, t), v_old, x0, xt, t, torch.full((2,), a), config=NFTConfig())
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 1e-3 * p.grad
            err_after = ((xt - t.view(-1, 1, 1, 1) * model(xt, t) - x0) ** 2).mean()
        assert (err_after < err_before) == closer


def test_mask_and_normalizer():
    x0, eps, t, adv = _batch(seed=9)
    model, old = TinyVelocity(10), TinyVelocity(11)
    xt = noised(x0, eps, t)
    with torch.no_grad():
        v_old = old(xt, t)
    mask = torch.tensor([True, True, False, True, False, True])
    v = model(xt, t)
    bad_old, bad_x0 = v_old.clone(), x0.clone()
    bad_old[2] = float("nan")
    bad_x0[4] = float("inf")
    loss, stats = nft_loss(v, bad_old, bad_x0, xt, t, adv, config=NFTConfig(), mask=mask)
    keep = mask.nonzero().flatten()
    ref_loss, _ = nft_loss(v[keep], v_old[keep], x0[keep], xt[keep], t[keep], adv[keep], config=NFTConfig())
    assert torch.isfinite(loss) and float(loss.detach()) == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    assert all(torch.isfinite(s) for s in stats.values())
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert all(torch.isfinite(g).all() for g in grads)
    # normalizer N: sum over real items / N (the trainer's 1/N weighting of one optimizer step)
    summed, _ = nft_loss(v, v_old, x0, xt, t, adv, config=NFTConfig(), mask=mask, normalizer=10)
    assert float(summed.detach()) == pytest.approx(float(ref_loss.detach()) * 4 / 10, rel=1e-6)


def test_optimality_hand_values_and_config_checks():
    r = optimality(torch.tensor([-10.0, -5.0, 0.0, 2.5, 5.0, 9.0]), 5.0)
    assert r.tolist() == pytest.approx([0.0, 0.0, 0.5, 0.75, 1.0, 1.0])
    for bad in ({"nft_beta": 0.0}, {"adv_clip": -1.0}, {"kl_beta": float("nan")}):
        with pytest.raises(ValueError):
            NFTConfig(**bad)
    x0, eps, t, adv = _batch()
    with pytest.raises(ValueError, match="ref_velocity"):
        nft_loss(x0, x0, x0, x0, t, adv, config=NFTConfig(kl_beta=0.1))
