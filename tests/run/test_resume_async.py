"""Exact resume after kill -9 (2): at TP=2 (rank 1 killed after an optimizer step, rank 0 inside a checkpoint
write: the previous checkpoint stays usable, no staging dir is left) and for DiffusionNFT in the asynchronous loop
(its sampling policy, the EMA and the batch collected ahead included; run beside a process keeping a core busy,
every non-timing value of its metrics rows equal to the quiet reference's), each resumed run ends with its
uninterrupted run's weights bit for bit. Split from test_resume.py so the two halves run on different test workers.

Reference: the same config run once without interruption. Tolerance: none (torch.equal).
Needs: CPU, real SGLang engines, 1-2 processes (torchrun for TP=2); ~5 min (slow)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megaflow.rundir.checkpoints import list_checkpoints
from resume_harness import NFT, assert_same_run, crash_and_resume, final_weights, measured, reference_run

pytestmark = [pytest.mark.slow, pytest.mark.engine]


def test_kill9_resume_is_exact_nft_async_beside_a_busy_process(tmp_path):
    # DiffusionNFT with a lagging sampling policy, an EMA and a warmed-up cosine lr, in the asynchronous loop
    # (train.max_staleness = 1: the engines sample iteration k + 1 while the trainer trains k, so every checkpoint
    # holds the batch collected ahead): killed midway through iteration 3's sync (the engines hold theta_old) and
    # after iteration 4's update (theta_old blended, the batch of 5 in flight, nothing checkpointed), all beside a
    # process that keeps a core busy; the model, theta_old and the EMA equal the quiet uninterrupted run's, which
    # trained on batches one version old, and so does every value of every metrics row but times and memory
    # (the engine batches by the request stream, never by the clock)
    extra = (*NFT, "--set", "train.max_staleness=1")
    reference = reference_run(tmp_path, tp=1, extra=extra)
    staleness = [json.loads(x).get("rollout/staleness")
                 for x in (reference / "metrics.jsonl").read_text().splitlines()]
    assert staleness == [None, 0.0, 1.0, 1.0, 1.0, 1.0], staleness
    assert (list_checkpoints(reference)[0][1] / "next_batch.safetensors").is_file()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        crashed = crash_and_resume(tmp_path, 1, ["sync@3", "train@4"], sigint_first=False, extra=extra)
    finally:
        busy.kill()
        busy.wait()
    assert_same_run(reference, crashed, shadows=("ema", "nft_old"))
    ref_rows, rows = ([{k: v for k, v in json.loads(x).items() if not measured(k)}
                       for x in (run / "metrics.jsonl").read_text().splitlines()] for run in (reference, crashed))
    assert rows == ref_rows and len(rows[-1]) > 25
    ema, trained = final_weights(reference, "ema"), final_weights(reference)
    assert any(not torch.equal(ema[k], trained[k]) for k in trained if isinstance(trained[k], torch.Tensor))



@pytest.mark.dist
def test_kill9_resume_is_exact_tp2(tmp_path):
    reference = reference_run(tmp_path, tp=2)
    # rank 1 killed after iteration 3's optimizer step; rank 0 killed inside iteration 4's checkpoint write
    crashed = crash_and_resume(tmp_path, 2, ["train@3:1", "checkpoint@4:0"], sigint_first=False)
    assert_same_run(reference, crashed)
    assert not list((crashed / "checkpoints").glob(".staging-*")), "a killed writer's staging dir was left"

