"""megaflow.testing.run_multiprocess: results in rank order, torchrun-like env, a gloo collective,
failures re-raised with the rank, hangs killed at the timeout (gloo, 2-3 local processes).

The first launch in a pytest process starts the forkserver, which preloads torch + megatron once
(~10-25 s here); later launches of every dist test reuse it. ``spawn`` (the GPU default) re-imports
per rank, so it is the slow variant."""
import os
import time

import pytest

from megaflow.testing import RankError, run_multiprocess

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _env_and_allreduce(scale):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "OMP_NUM_THREADS", "EXTRA")
    return {"sum": t.item() * scale, "env": {k: os.environ.get(k) for k in keys}, "pid": os.getpid()}


def _record_pid(tmp):
    with open(os.path.join(tmp, f"rank{os.environ['RANK']}.pid"), "w") as f:
        f.write(str(os.getpid()))


def _fail_on_rank_one(tmp):
    _record_pid(tmp)
    if int(os.environ["RANK"]) == 1:
        raise ValueError("boom on purpose")
    time.sleep(600)  # a healthy peer stuck waiting: must be killed after the failure


def _hang(tmp):
    _record_pid(tmp)
    time.sleep(600)


def _assert_ranks_gone(tmp, world_size):
    for rank in range(world_size):
        with open(os.path.join(tmp, f"rank{rank}.pid")) as f:
            pid = int(f.read())
        assert not os.path.exists(f"/proc/{pid}"), f"rank {rank} (pid {pid}) still exists"


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_results_in_rank_order_with_env_and_collective(start_method):
    out = run_multiprocess(
        _env_and_allreduce, 3, 2.0, env={"EXTRA": "x"}, timeout_s=120, start_method=start_method
    )
    assert [o["env"]["RANK"] for o in out] == ["0", "1", "2"]
    assert all(o["sum"] == 12.0 for o in out)  # (1+2+3) * 2
    assert {o["env"]["WORLD_SIZE"] for o in out} == {"3"}
    assert {o["env"]["MASTER_ADDR"] for o in out} == {"127.0.0.1"}
    assert {o["env"]["OMP_NUM_THREADS"] for o in out} == {"1"}
    assert {o["env"]["EXTRA"] for o in out} == {"x"}
    assert len({o["pid"] for o in out}) == 3 and os.getpid() not in {o["pid"] for o in out}


def test_failing_rank_is_reraised_with_its_number_and_peers_are_killed(tmp_path):
    with pytest.raises(RankError, match="rank 1 failed") as info:
        run_multiprocess(_fail_on_rank_one, 2, str(tmp_path), timeout_s=120)
    assert info.value.rank == 1
    assert "ValueError: boom on purpose" in info.value.remote_traceback
    _assert_ranks_gone(tmp_path, 2)  # rank 0 (sleeping 600 s) was killed, not waited for


def test_hang_is_killed_at_timeout(tmp_path):
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] still running after 10 s"):
        run_multiprocess(_hang, 2, str(tmp_path), timeout_s=10)
    _assert_ranks_gone(tmp_path, 2)
