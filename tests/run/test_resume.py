"""Exact resume after kill -9 (1): a FlowGRPO run SIGKILLed at chosen points (during rollout, right after the
optimizer step, midway through the weight sync) and stopped by SIGINT, then resumed with ``--resume`` each time,
ends with the uninterrupted single-process run's trainer weights bit for bit (fp32, CPU), at TP=1 and with a
disaggregated placement (an engine rank); both compare with one shared reference run. Also: metrics.jsonl holds every
iteration once with the same rewards, and no engine worker outlives a killed driver; a run dir is owned.
test_resume_async.py holds TP=2 (a kill inside a checkpoint write) and DiffusionNFT's asynchronous loop.

Reference: the same config run once without interruption. Tolerance: none (torch.equal).
Needs: CPU, real SGLang engines, 1-2 processes; ~5 min (slow)."""
from __future__ import annotations

from pathlib import Path

import pytest

from resume_harness import assert_same_run, crash_and_resume, reference_run, write_config

pytestmark = [pytest.mark.slow, pytest.mark.engine]


@pytest.fixture(scope="module")
def reference_tp1(tmp_path_factory) -> Path:
    """The uninterrupted single-process FlowGRPO run both the TP=1 and the disaggregated tests compare with (made
    once: a run's output depends on its config only, not on where it is written)."""
    return reference_run(tmp_path_factory.mktemp("reference_tp1"), tp=1)


def test_kill9_resume_is_exact_tp1(tmp_path, reference_tp1):
    reference = reference_tp1
    # SIGINT after iteration 1 (stops after iteration 1 or 2, with a checkpoint), then killed: in iteration 3's
    # rollout; after iteration 5's optimizer step (a kill mid-sync: the NFT and disaggregated tests; inside a
    # checkpoint write: the TP=2 test)
    crashed = crash_and_resume(tmp_path, 1, ["rollout@3", "train@5"], sigint_first=True)
    assert_same_run(reference, crashed)



@pytest.mark.dist
def test_disaggregated_sigint_kill9_resume_equals_single_process(tmp_path, reference_tp1):
    # 1 trainer rank + 1 engine rank: SIGINT stops both after a checkpoint (exit 130 on every rank);
    # then the driver is killed midway through iteration 3's weight sync (the engine rank goes with it);
    # the resumed run ends with the single-process run's weights
    reference = reference_tp1
    extra = ("--set", "rollout.placement=disaggregated", "--set", "rollout.engine_ranks=1",
             "--set", "bridge.mode=distributed")
    crashed = crash_and_resume(tmp_path, 1, ["sync@3:0"], sigint_first=True, extra=extra, nproc=2)
    assert_same_run(reference, crashed)



def test_run_dir_is_owned(tmp_path):
    """A rerun without --resume refuses a run with checkpoints; a finished run is never overwritten; a
    concurrent run with the same name refuses; all within the CLI's first second, writing nothing."""
    from megaflow.config import load_config
    from megaflow.rundir.claim import RunDir, check_run_dir
    config = write_config(tmp_path, "owned", 1)
    cfg = load_config(config, ["train.iterations=1"])
    held = RunDir(cfg, resume=False)  # as a live run holds it
    try:
        with pytest.raises(ValueError, match="in use by another run"):
            check_run_dir(cfg, resume=False)
        with pytest.raises(ValueError, match="in use by another run"):
            RunDir(cfg, resume=False)
    finally:
        held.release(failed=True)
    assert not (tmp_path / "runs" / "owned").exists(), "a run that never iterated left its dir behind"
    for bad in ("../escape", "a/b", ".hidden", ""):
        with pytest.raises(ValueError, match="run.name"):
            check_run_dir(load_config(config, [f'run.name="{bad}"']), resume=False)
