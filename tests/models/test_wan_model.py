"""megatron Wan at TP=1 vs diffusers WanTransformer3DModel: velocity and grads of the SFT loss on video latents
(3 latent frames; 4 frames patched in pairs by patch_size (2, 2, 2)), with and without the cross-attention
norm, with torch SDPA and with megatron's own
DotProductAttention (a dotted-path spec provider).

Needs: CPU, one gloo rank (a 1-process launch keeps megatron's global state out of pytest); diffusers in the
parent only. Tolerances: velocity and loss <= 1e-5 (abs, and relative to the largest velocity), grads <= 1e-5
(abs) vs diffusers, <= 1e-6 between the two core attentions. The multi-rank layouts are in test_parallel_parity.py.
"""
from __future__ import annotations

import pytest
import torch

from megaflow.models.wan import tiny
from megaflow.testing.dist import run_multiprocess

import parity_workers
from parity_cases import check_reports, make_case


@pytest.mark.dist
def test_tp1_matches_diffusers(tmp_path):
    layout = dict(spec="parity_workers:wan_core_attention_spec")
    cases = [make_case("wan", "t2v", tiny.tiny_config(), [layout]),
             make_case("wan", "no_cross_norm", tiny.tiny_config(cross_attn_norm=False), [layout]),
             make_case("wan", "frame_patch", tiny.tiny_config(patch_size=(2, 2, 2)), [layout], frames=4)]
    torch.save(cases, tmp_path / "cases.pt")
    (report,) = run_multiprocess(parity_workers.parity_rank, 1, str(tmp_path / "cases.pt"), timeout_s=300)
    for case in cases:
        ref = report[(case["name"], "tp1")]
        assert ref["out_err"] <= 1e-5 and ref["loss_err"] <= 1e-5 and ref["grad_err_vs_diffusers"] <= 1e-5, ref
        entry = report[(case["name"], str(layout))]
        assert entry["out_err"] <= 1e-5 and entry["grad_err"] <= 1e-6, entry
        assert report[(case["name"], "iter_full_params_exact")] is True
    check_reports([report], cases, relative=True)
