"""megaflow's performance patches of megatron-core (``megaflow.parallel.perf_patches.PERF_PATCHES``).

Per patch, in one gloo process (CPU): the slow megatron path it replaces is still megatron's own
(so a megatron upgrade that fixes it makes this fail and the patch can go), and the patched path
gives EXACTLY the results of megatron's (grad norm, clipped grads, linear outputs and grads:
tolerance 0). Engine-level bit-identity of all fast paths: tests/trainer/test_fast_paths.py.
Also (in-process, no megatron): the per-module torch view drops its name cache on layer changes.
"""
from __future__ import annotations

import sys
import types

import pytest
import torch

from megaflow.parallel import patching, perf_patches
from megaflow.testing.dist import run_multiprocess

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="module")
def report():
    import perf_patch_workers

    names = list(perf_patches.PERF_PATCHES)
    return run_multiprocess(perf_patch_workers.perf_patch_checks_rank, 1, names, timeout_s=300, env=CPU_ONLY)[0]


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(perf_patches.PERF_PATCHES))
def test_patch_is_needed_and_bit_identical(report, name):
    assert report[name]["needed"], f"{name}: megatron no longer takes the slow path -- patch still needed?"
    assert report[name]["identical"], f"{name}: patched results differ from megatron's"


@pytest.mark.dist
def test_remove_restores_megatron(report):
    assert report["_restored"]


def test_unknown_patch_name_is_rejected():
    with pytest.raises(ValueError, match="no_such_patch"):
        perf_patches.apply_perf_patches(skip={"no_such_patch"})


def test_torch_view_cache_follows_layer_changes():
    module = types.ModuleType("megaflow_fake_megatron_module")
    module.torch = torch
    sys.modules[module.__name__] = module
    try:
        first = patching.torch_view_patch((module.__name__,), torch_attrs={"zeros": "first"},
                                      cuda_attrs={"current_device": "cpu0"})
        second = patching.torch_view_patch((module.__name__,), torch_attrs={"ones": "second"})
        undo_first = first()
        assert module.torch.zeros == "first" and module.torch.cuda.current_device == "cpu0"
        assert module.torch.ones is torch.ones and "ones" in vars(module.torch)  # cached
        undo_second = second()
        assert module.torch.ones == "second" and module.torch.zeros == "first"
        undo_first()
        assert module.torch.zeros is torch.zeros and module.torch.cuda.current_device is torch.cuda.current_device
        undo_second()
        assert module.torch is torch
    finally:
        del sys.modules[module.__name__]
