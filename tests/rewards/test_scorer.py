"""Reward failure masking (every registered reward), weighted multi-reward, async scorer.
Needs: CPU, 1 process."""
import json
import logging
import threading

import pytest
import torch

from megaflow.shapeeval.render import render_prompts
from megaflow.config.preflight import SERVER_REWARDS
from megaflow.config.reward_files import MODEL_REWARDS
from megaflow.rewards import REWARDS, AsyncScorer, MultiReward, build_multi_reward, build_reward, safe_score

torch.set_num_threads(1)
KWARGS = {"cifar10": {"target": "ship"}}
PROMPTS = ["a red circle", "two blue squares", "a yellow triangle", "a green circle"]


def _batch():
    return torch.from_numpy(render_prompts(PROMPTS, resolution=32, seed=0)).permute(0, 3, 1, 2).float() / 255


class Flaky:
    """The real reward, except on samples whose metadata says ``fail``: raise or return NaN."""

    def __init__(self, inner, mode: str):
        self.inner, self.mode, self.calls = inner, mode, 0

    def __call__(self, images, prompts, metadata=None):
        self.calls += 1
        bad = [i for i, m in enumerate(metadata) if m.get("fail")]
        if self.mode == "raise" and bad:
            raise RuntimeError("boom")
        out = self.inner(images, prompts, metadata).clone()
        out[bad] = float("nan") if self.mode == "nan" else float("inf")
        return out


@pytest.mark.parametrize("mode", ["raise", "nan", "inf"])
@pytest.mark.parametrize("name", [n for n in REWARDS if n not in SERVER_REWARDS  # those: test_remote.py
                                  and n not in MODEL_REWARDS])  # need model files: test_clip_rewards.py
def test_failures_mask_only_the_failing_sample_and_warn(name, mode, caplog):
    real = build_reward(name, **KWARGS.get(name, {}))
    x, meta = _batch(), [{}, {"fail": True}, {}, {}]
    prompts = [f'"{p}"' for p in PROMPTS] if name == "ocr" else PROMPTS  # ocr reads its target in quotes
    clean = safe_score(real, x, prompts)
    with caplog.at_level(logging.WARNING, logger="megaflow.rewards"):
        out = safe_score(Flaky(real, mode), x, prompts, meta, name=name)
    assert torch.isnan(out[1])
    # Retried per sample after a raise: conv kernels may round differently at batch size 1.
    torch.testing.assert_close(out[[0, 2, 3]], clean[[0, 2, 3]], rtol=1e-5, atol=1e-6)
    text = caplog.text
    assert name in text and ("boom" if mode == "raise" else "non-finite") in text


def test_natural_failures_are_masked_and_a_bad_output_shape_is_an_error(caplog):
    from megaflow.rewards.base import RewardContractError

    x = _batch()
    with caplog.at_level(logging.WARNING, logger="megaflow.rewards"):
        out = safe_score(build_reward("shapeeval"), x, ["a red circle", "a red dog", "a triangle", "hello"])
    assert torch.isnan(out[[1, 3]]).all() and torch.isfinite(out[[0, 2]]).all()
    assert "a red dog" in caplog.text and "not a ShapeEval prompt" in caplog.text
    with pytest.raises(RewardContractError, match="reward 'bad_shape' returned scores of shape \\(7,\\) for 4"):
        safe_score(lambda im, p, m: torch.zeros(7), x, PROMPTS, name="bad_shape")  # the reward's bug: it stops
    with pytest.raises(ValueError, match="4 images but 3 prompts"):  # caller bug, not a reward failure
        safe_score(build_reward("shapeeval"), x, PROMPTS[:3])


def test_multi_reward_weights_components_and_mask_propagation():
    x, meta = _batch(), [{}, {}, {"fail": True}, {}]
    jpeg, shape = build_reward("jpeg_incompressibility"), build_reward("shapeeval_partial")
    multi = MultiReward([("jpeg", 0.25, jpeg), ("shape", 3.0, Flaky(shape, "raise"))])
    scores = multi.score(x, PROMPTS, meta)
    expected = 0.25 * jpeg(x, PROMPTS) + 3.0 * shape(x, PROMPTS)
    assert torch.isnan(scores.total[2]) and torch.isfinite(scores.components["jpeg"]).all()
    keep = [0, 1, 3]
    assert torch.allclose(scores.total[keep], expected[keep])
    assert scores.valid.tolist() == [True, True, False, True]
    assert set(scores.seconds) == {"jpeg", "shape"} and all(s >= 0 for s in scores.seconds.values())
    summary = scores.summary()
    json.dumps(summary)
    assert summary["reward/masked_frac"] == 0.25
    # A weight-0 component is reported but neither counted nor masking.
    report_only = MultiReward([("jpeg", 1.0, jpeg), ("shape", 0.0, Flaky(shape, "nan"))]).score(x, PROMPTS, meta)
    assert torch.isfinite(report_only.total).all() and torch.isnan(report_only.components["shape"][2])
    assert torch.allclose(report_only.total, jpeg(x, PROMPTS))


def test_async_scorer_matches_sync_and_snapshots_inputs():
    multi = build_multi_reward({"jpeg_compressibility": 1.0, "color_target": 2.0, "shapeeval": 1.0})
    batches = [_batch(), _batch().flip(-1), 1.0 - _batch()]
    with AsyncScorer(multi, num_workers=2) as scorer:
        sync = [scorer.score(b, PROMPTS) for b in batches]
        futures = [scorer.submit(b, PROMPTS) for b in batches]
        batches[0].zero_()  # the sampler reuses its buffer: must not affect the queued batch
        results = [f.result(timeout=60) for f in futures]
    for s, r in zip(sync, results):
        assert torch.equal(s.total, r.total)
        assert all(torch.equal(s.components[k], r.components[k]) for k in s.components)


def test_async_submit_returns_before_scoring_finishes():
    release = threading.Event()

    def slow(images, prompts, metadata):
        assert release.wait(timeout=30)
        return torch.ones(len(prompts))

    with AsyncScorer(MultiReward([("slow", 1.0, slow)])) as scorer:
        fut = scorer.submit(_batch(), PROMPTS)
        assert not fut.done()  # submit did not block on the reward
        release.set()
        assert torch.equal(fut.result(timeout=30).total, torch.ones(4))
    with pytest.raises(ValueError, match="num_workers"):
        AsyncScorer(MultiReward([("slow", 1.0, slow)]), num_workers=0)
