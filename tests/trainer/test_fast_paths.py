"""Trainer fast paths (``megaflow.trainer.runner.FastPaths``): bit-identical and still needed.

Needs: CPU, gloo world of 1 (one launch). Every variant (all fast paths off = megatron's own code,
all on, each one alone) runs the same two Adam steps of 2 microbatches (grad clipping active)
from the same weights; losses, grad norms, accumulated grads and updated weights must be EXACTLY
equal (tolerance 0). Each single-rank fast path must still skip real megatron work at world size
1 (a per-parameter hook copy, collectives over size-1 groups, split Adam groups), so a megatron
upgrade that removes that work makes this test fail and the fast path can go.
"""
from __future__ import annotations

import pytest

from megaflow.models.sd3 import tiny
from megaflow.testing.dist import run_multiprocess

import fast_path_workers

pytestmark = [pytest.mark.dist]


@pytest.fixture(scope="module")
def report():
    dcfg = tiny.tiny_config(qk_norm="rms_norm", num_layers=2)
    return run_multiprocess(fast_path_workers.fast_paths_rank, 1, dcfg, timeout_s=300)[0]


def test_every_variant_is_bit_identical_to_megatron(report):
    assert report["clipped"]  # the clip path (norm + scale) is exercised
    assert report["differs"] == []


def test_each_fast_path_switches_alone(report):
    active = report["active"]
    assert active["plain"] == []
    for name, on in active.items():
        if name not in ("plain", "all"):
            assert on == [name], (name, on)
    assert sorted(active["all"]) == sorted(n for n in active if n not in ("plain", "all"))


def test_single_rank_fast_paths_still_needed(report):
    n = report["needed"]
    assert n["megatron_hooks"] == n["params"] > 0 and n["megatron_grads_dropped"]
    assert n["fast_hooks"] == 0 and n["fast_main_grad_is_grad"]
    assert n["finalize_collectives"] >= 1 and n["fast_finalize_func"] is None
    assert n["plain_step_collectives"] >= 1 and n["fast_step_collectives"] == 0
    assert n["adam_groups"] >= 2 and n["adam_groups_equal"]


def test_single_rank_ddp_with_a_parameter_without_grad(report):
    u = report["unused_param"]
    assert u["equal"] and u["unused_zero"] and u["rezeroed"]
