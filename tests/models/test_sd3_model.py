"""megatron SD3 MMDiT at TP=1 vs diffusers: velocity and grads of the SFT loss.

Needs: CPU, one gloo rank (a 1-process launch keeps megatron's global state out of pytest);
diffusers in the parent only. Tolerances: velocity <= 1e-5, grads <= 1e-5 (abs). The multi-rank
layouts are in test_parallel_parity.py (slow).
"""
from __future__ import annotations

import pytest
import torch

from megaflow.models.common import spec
from megaflow.models.sd3 import tiny
from megaflow.testing.dist import run_multiprocess

import parity_workers
from parity_cases import make_case


@pytest.mark.dist
def test_tp1_matches_diffusers(tmp_path):
    providers = ["parity_workers:sd3_core_attention_spec", "parity_workers:sd3_whole_model_provider"]
    cases = [make_case("sd3", "sd35", tiny.tiny_config(qk_norm="rms_norm", dual_attention_layers=(1,)),
                       [dict(spec=p) for p in providers])]
    torch.save(cases, tmp_path / "cases.pt")
    (report,) = run_multiprocess(parity_workers.parity_rank, 1, str(tmp_path / "cases.pt"), timeout_s=300)
    ref = report[("sd35", "tp1")]
    assert ref["out_err"] <= 1e-5 and ref["loss_err"] <= 1e-5 and ref["grad_err_vs_diffusers"] <= 1e-5, ref
    for p in providers:  # a spec with megatron's own DotProductAttention; a provider of whole models
        entry = report[("sd35", str({"spec": p}))]
        assert entry["out_err"] <= 1e-5 and entry["grad_err"] <= 1e-6, (p, entry)
    assert report[("sd35", "iter_full_params_exact")] is True


def test_spec_impl_resolution():
    assert spec.resolve_impl("local") == "local"
    assert spec.resolve_impl("auto") == ("te" if spec.HAVE_TE and torch.cuda.is_available() else "local")
    with pytest.raises(ValueError, match="'fast'"):
        spec.resolve_impl("fast")
    if not spec.HAVE_TE:
        with pytest.raises(ValueError, match="transformer_engine"):
            spec.resolve_impl("te")
