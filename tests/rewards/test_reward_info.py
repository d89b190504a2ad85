"""Rewards returning ``(scores, info)``: scores used, info reported as ``reward/<label>/<key>`` (means), kept
through the per-sample retry, batch concatenation and a host's share. Needs: CPU, 1 process."""
import logging
import math

import pytest
import torch

from megaflow.rewards import MultiReward, build_multi_reward, safe_score
from megaflow.rewards.base import score_with_info
from megaflow.rollout.exchange import pack_share, unpack_share
from megaflow.rollout.types import RewardScores, RolloutRequest, Trajectory

torch.set_num_threads(1)


def brightness_with_info(images, prompts, metadata):
    scores = images.flatten(1).mean(1)
    return scores, {"foo": 1.5, "per_sample": [float(i) for i in range(len(prompts))],
                    "nan_ok": [float("nan"), 2.0] if len(prompts) == 2 else 2.0}


def _images(*values):
    return torch.stack([torch.full((3, 4, 4), v) for v in values])


def test_tuple_reward_scores_are_used_and_info_reported():
    multi = MultiReward([("bright", 2.0, brightness_with_info), ("plain", 1.0, lambda im, p, m: torch.ones(len(p)))])
    scores = multi.score(_images(0.25, 0.75), ["a", "b"])
    torch.testing.assert_close(scores.components["bright"], torch.tensor([0.25, 0.75]))
    torch.testing.assert_close(scores.total, torch.tensor([1.5, 2.5]))
    summary = scores.summary()
    assert summary["reward/bright/foo"] == 1.5
    assert summary["reward/bright/per_sample"] == 0.5  # mean of [0, 1]
    assert summary["reward/bright/nan_ok"] == 2.0  # non-finite entries left out
    assert not any(k.startswith("reward/plain/") for k in summary)


def test_custom_reward_by_dotted_path_reports_info(tmp_path, monkeypatch):
    (tmp_path / "megaflow_test_info_reward.py").write_text(
        "def reward(images, prompts, metadata):\n"
        "    return images.flatten(1).mean(1), {'foo': 1.5}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    multi = build_multi_reward({"megaflow_test_info_reward:reward": 1.0})
    scores = multi.score(_images(0.5, 1.0), ["a", "b"])
    torch.testing.assert_close(scores.total, torch.tensor([0.5, 1.0]))
    assert scores.summary()["reward/megaflow_test_info_reward:reward/foo"] == 1.5


def test_info_survives_the_per_sample_retry_and_bad_info_is_dropped(caplog):
    def flaky(images, prompts, metadata):
        if len(prompts) > 1:
            raise RuntimeError("batch refused")
        return images.flatten(1).mean(1), {"foo": float(images.mean()) * 10, "bad": "text"}

    with caplog.at_level(logging.WARNING, logger="megaflow.rewards"):
        scores, info = score_with_info(flaky, _images(0.1, 0.3), ["a", "b"], name="flaky")
    torch.testing.assert_close(scores, torch.tensor([0.1, 0.3]))
    assert info == {"foo": pytest.approx(2.0)}
    assert "info 'bad'" in caplog.text
    torch.testing.assert_close(safe_score(flaky, _images(0.2), ["a"]), torch.tensor([0.2]))


def test_concat_weights_info_by_batch_size_and_a_share_carries_it():
    def part(n, foo):
        return RewardScores(total=torch.ones(n), components={"r": torch.ones(n)}, weights={"r": 1.0},
                            seconds={"r": 0.1}, info={"r/foo": foo})
    merged = RewardScores.concat([part(1, 1.0), part(3, 3.0), part(2, float("nan"))])
    assert merged.info["r/foo"] == pytest.approx((1.0 + 9.0) / 4)
    assert math.isnan(RewardScores.concat([part(1, float("nan"))]).info["r/foo"])

    req = RolloutRequest(prompt="p", num_outputs=2)
    trajs = [Trajectory(**req.trajectory_fields(), index=j, seed=s, log_prob_no_const=False,
                        latents=torch.zeros(2, 1, 2, 2), sigmas=torch.tensor([1.0, 0.0]), log_probs=torch.zeros(1),
                        sde_mask=torch.ones(1, dtype=torch.bool),
                        conditioning={"pooled_projections": torch.zeros(2)})
             for j, s in enumerate(req.output_seeds())]
    _, back = unpack_share(pack_share(trajs, part(2, 0.25), 1.0), [req], host=0)
    assert back.info == {"r/foo": 0.25}
    assert back.summary()["reward/r/foo"] == 0.25
