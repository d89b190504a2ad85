"""Trainer: Adam training steps vs a diffusers + torch AdamW reference, checkpoint resume, and
resharded loading (TP=2+SP -> PP=2), a checkpoint with a NaN in one rank's shard refused on every rank, and
``refuse_non_finite`` on a pipeline's state dict.

Needs: CPU, gloo, 2 processes (one launch), diffusers in the parent only. Tolerances: per-step
SFT losses vs the reference <= 1e-5; resumed step 4 vs uninterrupted step 4: loss <= 1e-6 and
params <= 1e-6; weights loaded at another layout: bit-exact.
"""
from __future__ import annotations

import pytest
import torch

from megaflow.models.sd3 import tiny
from megaflow.testing.dist import run_multiprocess

import runner_workers


def _reference_losses(model, batches, steps: int) -> list[float]:
    """Losses of ``steps`` AdamW steps (lr 1e-3, no weight decay, clip 1.0) on the same batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        loss, _ = tiny.diffusers_sft_reference(model, batches)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss)
    return losses


@pytest.mark.slow
@pytest.mark.dist
def test_train_steps_match_reference_and_checkpoint_resume(tmp_path):
    torch.set_num_threads(1)
    dcfg = tiny.tiny_config(qk_norm="rms_norm")
    model = tiny.diffusers_model(dcfg, seed=7)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batches = tiny.sft_batches(dcfg, num_microbatches=2, batch=2, context_len=6, seed=2)
    ref = _reference_losses(model, batches, steps=3)
    torch.save(dict(dcfg=dcfg, state=state, batches=batches), tmp_path / "case.pt")

    out = run_multiprocess(runner_workers.train_save_resume_rank, 2, str(tmp_path / "case.pt"),
                           str(tmp_path / "ckpt"), timeout_s=600)
    for r in out:
        assert not [n for n in r["fast_paths"] if n.startswith("single_rank")]  # 2 ranks: megatron's own DDP path
        assert max(abs(a - b) for a, b in zip(r["losses"], ref)) <= 1e-5, (r["losses"], ref)
        assert r["losses"][2] < r["losses"][0]  # it trains
        assert abs(r["step4"] - r["resumed4"]) <= 1e-6
        assert r["resume_param_err"] <= 1e-6 and r["moved"] > 1e-4
        assert r["pp2_mismatch"] == []
        # resumed from the checkpoint saved before the first step: the same 3 steps, the same weights
        assert r["fresh_losses"] == r["losses"] and r["fresh_param_err"] == 0.0
        # a NaN in rank 1's shard only: every rank refuses the checkpoint with the same line (none waits alone)
        assert r["nan_error"] is not None and "ckpt-nan" in r["nan_error"] and "non-finite" in r["nan_error"]
        assert "\n" not in r["nan_error"] and r["nan_error"] == out[0]["nan_error"]


def test_non_finite_weights_are_one_line():
    from megaflow.models.common.finite import refuse_non_finite
    good = {"a": torch.ones(3), "steps": torch.tensor([1, 2])}  # integer tensors are not checked
    refuse_non_finite(good.items(), "pipe/transformer")
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.ones(4)
        t[2] = bad
        with pytest.raises(ValueError) as e:
            refuse_non_finite([*good.items(), ("blocks.0.w", t)], "pipe/transformer")
        msg = str(e.value)
        assert msg.startswith("pipe/transformer: blocks.0.w holds 1 non-finite value(s)") and "\n" not in msg
