"""``ShadowWeights.equals_live``: true exactly while the shadow holds the live weights (creation, a blend with decay
0) and nothing wrote to either since; the DGPO update skips the fast EMA's forward then. Needs: CPU, < 1 s."""
import torch

from megaflow.trainer.shadow import ShadowWeights


def _params():
    torch.manual_seed(0)
    return {"w": torch.nn.Parameter(torch.randn(3, 4)), "b": torch.nn.Parameter(torch.randn(4).to(torch.bfloat16))}


def _same(shadow, params) -> bool:  # the independent check: the values themselves
    return all(torch.equal(shadow.tensors[n].to(p.dtype), p.detach()) for n, p in params.items())


def test_equals_live_follows_every_write():
    params = _params()
    shadow = ShadowWeights(params)
    assert shadow.equals_live() and _same(shadow, params)
    with torch.no_grad():
        params["w"].add_(1.0)  # an optimizer step
    assert not shadow.equals_live() and not _same(shadow, params)
    shadow.blend(0.0)
    assert shadow.equals_live() and _same(shadow, params)
    shadow.blend(0.5)  # a mixing blend of equal values: still equal in value, but no longer claimed
    assert not shadow.equals_live()
    shadow.blend(0.0)
    shadow.tensors["b"].mul_(2.0)  # a write to the shadow itself (a test's perturbation, a checkpoint load)
    assert not shadow.equals_live() and not _same(shadow, params)
    shadow.blend(0.0)
    with shadow.applied():  # writes the live parameters (twice): no longer claimed afterwards
        pass
    assert not shadow.equals_live() and _same(shadow, params)
    shadow.blend(0.0)
    shadow.load_state_dict(shadow.state_dict())
    assert not shadow.equals_live()
