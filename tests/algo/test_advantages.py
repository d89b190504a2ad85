"""FlowGRPO advantages on small explicit tensors, hand-computed. Needs: CPU, 1 process (torch only)."""
import math

import pytest
import torch

import megaflow  # noqa: F401
from megaflow.algo.advantages import AdvantageConfig, contiguous_group_ids, group_advantages

torch.set_num_threads(1)
EPS = 1e-4
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])
REWARDS = torch.tensor([1.0, 2.0, 3.0, 2.0, 4.0, 6.0])


def test_batch_std_hand_values():
    # group means 2 and 4; batch population std of {1,2,3,2,4,6} (mean 3): sqrt(16/6)
    std = math.sqrt(16 / 6)
    out = group_advantages(REWARDS, GROUPS)
    expected = torch.tensor([-1, 0, 1, -2, 0, 2], dtype=torch.float64) / (std + EPS)
    torch.testing.assert_close(out.advantages, expected.float(), atol=1e-6, rtol=0)
    assert out.advantages.dtype == torch.float32
    assert out.keep.all() and out.dropped_ratio == 0.0


def test_group_std_hand_values():
    out = group_advantages(REWARDS, GROUPS, AdvantageConfig(std_mode="group"))
    g0, g1 = math.sqrt(2 / 3), math.sqrt(8 / 3)
    expected = [-1 / (g0 + EPS), 0, 1 / (g0 + EPS), -2 / (g1 + EPS), 0, 2 / (g1 + EPS)]
    torch.testing.assert_close(out.advantages, torch.tensor(expected), atol=1e-6, rtol=0)


def test_clip():
    out = group_advantages(torch.tensor([0.0, 10.0]), torch.tensor([0, 0]),
                           AdvantageConfig(std_mode="group", adv_clip=0.5))
    torch.testing.assert_close(out.advantages, torch.tensor([-0.5, 0.5]))
    assert out.stats["adv_clip_frac"] == 1.0


def test_zero_std_group_is_dropped_and_reported():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 2.0])
    out = group_advantages(rewards, GROUPS)
    assert out.keep.tolist() == [False, False, False, True, True, True]
    assert out.zero_std_group.tolist() == [True, True, True, False, False, False]
    assert out.dropped_ratio == 0.5 and out.stats["zero_std_groups"] == 1.0
    assert out.advantages[:3].tolist() == [0.0, 0.0, 0.0]
    # batch std still uses every valid reward (flow_grpo: np.std over the whole batch)
    std = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 2.0], dtype=torch.float64).std(correction=0).item()
    torch.testing.assert_close(out.advantages[3:], torch.tensor([-1.0, 0.0, 1.0]) / (std + EPS))
    unfiltered = group_advantages(rewards, GROUPS, AdvantageConfig(filter_zero_std=False))
    assert unfiltered.keep.all() and unfiltered.dropped_ratio == 0.0


def test_nan_rewards_are_masked_and_excluded_from_statistics():
    rewards = torch.tensor([1.0, float("nan"), 3.0, 2.0, 4.0, 6.0])
    out = group_advantages(rewards, GROUPS)
    assert out.valid.tolist() == [True, False, True, True, True, True]
    assert not out.keep[1] and out.advantages[1] == 0.0
    # the same as the batch without the masked sample
    keep = torch.tensor([0, 2, 3, 4, 5])
    ref = group_advantages(rewards[keep], GROUPS[keep])
    torch.testing.assert_close(out.advantages[keep], ref.advantages, atol=0, rtol=0)
    # hand: group 0 mean 2 (NaN excluded); std of {1,3,2,4,6} = sqrt(14.8/5)
    std = math.sqrt(14.8 / 5)
    assert out.advantages[0].item() == pytest.approx(-1 / (std + EPS), abs=1e-6)
    assert out.stats["masked_ratio"] == pytest.approx(1 / 6)
    assert math.isfinite(out.stats["reward_mean"])


def test_group_with_one_valid_sample_has_zero_std():
    rewards = torch.tensor([float("nan"), 5.0, float("inf"), 1.0, 2.0, 3.0])
    out = group_advantages(rewards, GROUPS)
    assert out.keep.tolist() == [False, False, False, True, True, True]
    assert out.dropped_ratio == pytest.approx(1 / 4)


def test_all_masked_group():
    rewards = torch.tensor([float("nan")] * 3 + [1.0, 2.0, 3.0])
    out = group_advantages(rewards, GROUPS)
    assert out.keep.tolist() == [False, False, False, True, True, True]
    assert out.dropped_ratio == 0.0 and out.stats["zero_std_groups"] == 0.0


def test_group_ids_need_not_be_contiguous():
    ids = torch.tensor([7, 3, 7, 3, 7, 3])
    perm = torch.tensor([0, 2, 4, 1, 3, 5])  # sample order grouped as 7,7,7,3,3,3
    shuffled = torch.empty_like(REWARDS)
    shuffled[perm] = REWARDS
    out = group_advantages(shuffled, ids)
    ref = group_advantages(REWARDS, GROUPS)
    torch.testing.assert_close(out.advantages[perm], ref.advantages, atol=0, rtol=0)


def test_contiguous_group_ids():
    assert contiguous_group_ids(6, 3).tolist() == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError):
        contiguous_group_ids(5, 2)


@pytest.mark.parametrize("call", [
    lambda: group_advantages(REWARDS.view(2, 3), GROUPS),
    lambda: group_advantages(REWARDS, GROUPS[:4]),
    lambda: group_advantages(REWARDS, GROUPS.float()),
    lambda: group_advantages(torch.tensor([]), torch.tensor([], dtype=torch.long)),
    lambda: AdvantageConfig(std_mode="prompt"),
    lambda: AdvantageConfig(adv_clip=0.0),
])
def test_bad_inputs_raise(call):
    with pytest.raises(ValueError):
        call()
