"""The SGLang engine's batching plan (megaflow.rollout.sglang.engine.plan_calls): the calls of one ``submit`` are a
function of its request list alone, so the same requests always run in the same batches, whatever the machine's
load. Needs: CPU, 1 process (pure logic; no engine is started)."""
from __future__ import annotations

from megaflow.rollout.sglang.engine import plan_calls
from megaflow.rollout.types import RolloutRequest


def _group(g: int, n: int = 8, **kw) -> RolloutRequest:
    return RolloutRequest(prompt=f"prompt {g}", num_outputs=n, seeds=list(range(n)), num_steps=10, height=32,
                          width=32, sde_type="ode", request_id=f"g{g}", **kw)


def test_the_demo_rollout_fills_calls_in_request_order():
    """12 groups of 8 with at most 64 samples a call: the first 8 groups, then the last 4."""
    assert plan_calls([_group(g) for g in range(12)], max_outputs=64) == [list(range(8)), list(range(8, 12))]


def test_incompatible_requests_and_cfg_never_share_a_call():
    requests = [_group(0), _group(1), _group(2, n=3),
                RolloutRequest(prompt="cfg", num_outputs=2, seeds=[0, 1], num_steps=10, height=32, width=32,
                               do_cfg=True, guidance_scale=4.5, request_id="c"),
                RolloutRequest(prompt="other size", num_outputs=2, seeds=[0, 1], num_steps=10, height=64, width=64,
                               sde_type="ode", request_id="big"),
                _group(5, n=5)]
    # the open call of the 32x32 ODE signature takes groups 0, 1 and 2 (19 samples), not group 5 (24 > 20);
    # the CFG request runs alone; the 64x64 request opens its own call
    assert plan_calls(requests, max_outputs=20) == [[0, 1, 2], [3], [4], [5]]
    assert plan_calls(requests, max_outputs=24) == [[0, 1, 2, 5], [3], [4]]


def test_merge_off_and_oversized_groups_run_alone():
    assert plan_calls([_group(0), _group(1)], max_outputs=64, merge=False) == [[0], [1]]
    assert plan_calls([_group(0, n=40), _group(1, n=40), _group(2, n=4)], max_outputs=32) == [[0], [1], [2]]


def test_clips_of_other_lengths_never_share_a_call():
    """A video's frame count is part of its signature: 5-frame clips merge, a 9-frame clip and an image do not."""
    requests = [_group(0, n=2, num_frames=5), _group(1, n=2, num_frames=9), _group(2, n=2, num_frames=5), _group(3, n=2)]
    assert plan_calls(requests, max_outputs=16) == [[0, 2], [1], [3]]
