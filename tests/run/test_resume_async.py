"""Exact resume after kill -9 (2): DiffusionNFT in the asynchronous loop at TP=2 (its sampling policy, the EMA and
the batch collected ahead included), killed on the driver midway through a weight sync, on rank 1 right after an
optimizer step and on rank 0 inside a checkpoint write (the previous checkpoint stays usable, no staging dir is
left), all beside a process keeping a core busy; the resumed run ends with the uninterrupted run's weights, theta_old
and EMA bit for bit, and every non-timing value of its metrics rows equals the quiet reference's. One crash chain
(module fixture) serves both tests: TP=2's sharded checkpoints then carry the shadows too.
Split from test_resume.py so the two halves run on different test workers.

Reference: the same config run once without interruption. Tolerance: none (torch.equal).
Needs: CPU, real SGLang engines, torchrun with 2 processes, 5 launches; ~5 min (slow)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megaflow.rundir.checkpoints import list_checkpoints
from resume_harness import NFT, assert_same_run, crash_and_resume, final_weights, measured, reference_run

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.dist]
# DiffusionNFT with a lagging sampling policy, an EMA and a warmed-up cosine lr, in the asynchronous loop
# (train.max_staleness = 1: the engines sample iteration k + 1 while the trainer trains k, so every checkpoint holds
# the batch collected ahead)
EXTRA = (*NFT, "--set", "train.max_staleness=1")
# killed on the driver midway through iteration 3's sync (the engines hold theta_old); on rank 1 after iteration 4's
# update (theta_old blended, the batch of 5 in flight, nothing checkpointed); on rank 0 inside iteration 4's
# checkpoint write. Each resumes from iteration 2's checkpoint (save_every = 2).
FAULTS = ["sync@3:0", "train@4:1", "checkpoint@4:0"]


@pytest.fixture(scope="module")
def nft_tp2(tmp_path_factory) -> tuple[Path, Path]:
    """(the uninterrupted quiet run, the same run crashed at FAULTS and resumed beside a busy process)."""
    tmp = tmp_path_factory.mktemp("nft_tp2")
    reference = reference_run(tmp, tp=2, extra=EXTRA)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        crashed = crash_and_resume(tmp, 2, FAULTS, sigint_first=False, extra=EXTRA)
    finally:
        busy.kill()
        busy.wait()
    return reference, crashed


def test_kill9_resume_is_exact_nft_async_beside_a_busy_process(nft_tp2):
    # the model, theta_old and the EMA equal the quiet uninterrupted run's, which trained on batches one version
    # old, and so does every value of every metrics row but times and memory (the engine batches by the request
    # stream, never by the clock)
    reference, crashed = nft_tp2
    staleness = [json.loads(x).get("rollout/staleness")
                 for x in (reference / "metrics.jsonl").read_text().splitlines()]
    assert staleness == [None, 0.0, 1.0, 1.0, 1.0, 1.0], staleness
    assert (list_checkpoints(reference)[0][1] / "next_batch.safetensors").is_file()
    assert_same_run(reference, crashed, shadows=("ema", "nft_old"))
    ref_rows, rows = ([{k: v for k, v in json.loads(x).items() if not measured(k)}
                       for x in (run / "metrics.jsonl").read_text().splitlines()] for run in (reference, crashed))
    assert rows == ref_rows and len(rows[-1]) > 25
    ema, trained = final_weights(reference, "ema"), final_weights(reference)
    assert any(not torch.equal(ema[k], trained[k]) for k in trained if isinstance(trained[k], torch.Tensor))


def test_kill9_resume_is_exact_tp2(nft_tp2):
    # rank 1 killed after an optimizer step and rank 0 inside a checkpoint write: the TP=2 run (2 trainer ranks,
    # sharded checkpoints) ends with its uninterrupted run's weights
    reference, crashed = nft_tp2
    assert all("tp = 2" in (run / "config.toml").read_text() for run in (reference, crashed))
    assert_same_run(reference, crashed)
    assert not list((crashed / "checkpoints").glob(".staging-*")), "a killed writer's staging dir was left"
