"""The KL reference (``ReferenceModel``, built by megaflow.run.build.build_trainer when algo.kl_beta > 0) vs the
old reference (a Trainer without optimizer, DDP-wrapped, grads switched off afterwards).

Needs: CPU, gloo, 2 processes (one launch). Layouts DP=2 (TP=1), TP=2, TP=2+SP, PP=2, and TP=2 in bf16.
Checks: the velocities grpo's ``attach_reference`` reads are bitwise equal; the new reference holds no grad
buffer and the same parameter bytes (so old - new = the DDP grad buffer, fp32: 4 bytes per local parameter);
every parameter frozen; the chunks are unwrapped (Float16Module only in bf16); backward is refused. A trainable
policy's forward-only pass (the old-policy, EMA and pre-update passes of the algorithms) gives bitwise the velocities
of its training pass and records no autograd graph.
"""
from __future__ import annotations

import pytest
import torch

from megaflow.models.sd3 import tiny
from megaflow.testing.dist import run_multiprocess

import reference_workers

LAYOUTS = [dict(), dict(tp=2), dict(tp=2, sp=True), dict(pp=2), dict(tp=2, bf16=True)]


@pytest.mark.slow
@pytest.mark.dist
def test_reference_engine_matches_old_path_without_grad_buffer(tmp_path):
    torch.set_num_threads(1)
    dcfg = tiny.tiny_config(qk_norm="rms_norm", dual_attention_layers=(0,))
    model = tiny.diffusers_model(dcfg, seed=5)
    case = dict(dcfg=dcfg, state={k: v.detach().clone() for k, v in model.state_dict().items()},
                batches=tiny.sft_batches(dcfg, num_microbatches=2, batch=2, context_len=6, seed=4))
    torch.save(case, tmp_path / "case.pt")
    reports = run_multiprocess(reference_workers.compare_rank, 2, str(tmp_path / "case.pt"), LAYOUTS, timeout_s=600)
    last_stage_seen = set()
    for rank, report in enumerate(reports):
        assert report.pop("refuses_backward") is True
        assert len(report) == len(LAYOUTS)
        for key, e in report.items():
            print(rank, key, e)
            if e["equal"] is not None:
                last_stage_seen.add(key)
                assert e["equal"] and e["scale"] > 1e-2, (rank, key, e)
                assert e["policy_equal"], (rank, key, e)
            assert e["policy_graph"] is False, (rank, key, e)
            old, new = e["old_bytes"], e["new_bytes"]
            assert new["grad_buffers"] == 0 and new["params"] == old["params"], (rank, key, e)
            assert old["grad_buffers"] >= old["params"] * (2 if "'bf16': True" in key else 1), (rank, key, e)
            assert e["frozen"], (rank, key, e)
            assert e["wrapped"] == ["Float16Module" if "'bf16': True" in key else "SD3MMDiT"], (rank, key, e)
    assert len(last_stage_seen) == len(LAYOUTS)
