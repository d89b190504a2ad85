"""Each megaflow CPU shim is still needed and sufficient on the installed megatron-core
(gloo, 1 process with CUDA hidden, so it runs the CPU path on any machine).

For every shim: with only that shim removed, the smallest megatron operation that needs it must
fail inside the megatron module(s) the shim patches; with all shims applied it must succeed.
If a megatron upgrade makes a shim unnecessary (no failure) or insufficient (failure with all on),
this test fails. Also: removing every shim restores megatron's own module globals.
"""
import re

import pytest

from megaflow.parallel import cpu
from megaflow.testing import run_multiprocess

pytestmark = [pytest.mark.dist, pytest.mark.slow]
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}

# Where, inside megatron/core/, the failure must come from when the shim is off.
EXPECTED = {
    "rng_tracker": (r"CUDA|NVIDIA", "tensor_parallel/random.py"),
    "allocation_device": (r"CUDA|NVIDIA", "tensor_parallel/layers.py"),
    "pipeline_device": (r"CUDA|NVIDIA", "pipeline_parallel/schedules.py"),
    "ddp_grad_buffer": (r"CUDA|NVIDIA", "distributed/param_and_grad_buffer.py"),
    "optimizer_device": (r"CUDA|NVIDIA", "optimizer/optimizer.py"),
    "clip_grads_type": (r"AssertionError", "optimizer/clip_grads.py"),
    "optimizer_type_names": (r"torch\.cuda\.FloatTensor", "optimizer/distrib_optimizer.py"),
    "dist_ckpt_device": (r"CUDA|NVIDIA", "dist_checkpointing/strategies/filesystem_async.py"),
}


@pytest.fixture(scope="module")
def report():
    import shim_check_workers

    names = list(cpu.SHIMS)
    return run_multiprocess(shim_check_workers.shim_checks_rank, 1, names, timeout_s=300, env=CPU_ONLY)[0]


def test_every_shim_has_a_check():
    assert set(EXPECTED) == set(cpu.SHIMS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_shim_is_needed_and_sufficient(report, name):
    pattern, where = EXPECTED[name]
    off, on = report[name]["off"], report[name]["on"]
    assert off is not None, f"{name}: megatron op succeeded without the shim -- shim no longer needed?"
    assert re.search(pattern, off["error"]), f"{name}: unexpected failure {off}"
    assert off["where"] == where, f"{name}: failed elsewhere than expected: {off}"
    assert on is None, f"{name}: fails even with all shims applied: {on}"


def test_remove_restores_megatron(report):
    assert report["_restored"]


def test_unknown_shim_name_is_rejected():
    with pytest.raises(ValueError, match="no_such_shim"):
        cpu.apply_cpu_shims(skip={"no_such_shim"})


def test_version_guard_names_both_versions():
    cpu.check_mcore_version()  # the pinned version is installed
    with pytest.raises(RuntimeError, match=r"0\.19\.2.*0\.20\.0"):
        cpu.check_mcore_version("0.20.0")
