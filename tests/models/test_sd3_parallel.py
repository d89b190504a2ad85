"""megatron SD3 MMDiT vs diffusers SD3Transformer2DModel across parallel layouts.

Needs: CPU, gloo, 4 processes (one launch runs every layout), diffusers in the parent only.
Cases: SD3 (no q/k norm) and SD3.5-medium-like (qk_norm="rms_norm" + dual attention blocks),
random fp32 weights. Layouts: TP=1 (reference), TP=2, TP=2+SP, PP=2, PP=2xVPP=2, TP2xPP2,
TP2xPP2+SP, TP=2 with megatron's own DotProductAttention via a dotted-path spec provider.
Tolerances: velocity and loss vs diffusers <= 1e-5 (abs); full grads vs the TP=1 megatron run
<= 1e-6 (abs; grads are O(0.1-1)); TP=1 grads vs diffusers grads <= 1e-5.
"""
from __future__ import annotations

import pytest
import torch

from megaflow.models.sd3 import tiny
from megaflow.testing.dist import run_multiprocess

import common_workers
import sd3_workers

LAYOUTS = [
    dict(tp=2), dict(tp=2, sp=True), dict(pp=2), dict(pp=2, vpp=2), dict(tp=2, pp=2),
    dict(tp=2, pp=2, sp=True), dict(tp=2, spec="sd3_workers:megatron_core_attention_spec"),
]


def make_case(name: str, dcfg: dict) -> dict:
    """Diffusers reference: velocity on microbatch 0 (``ref_velocities``: a list of one), SFT loss and
    grads (mapped to megatron names)."""
    from megaflow.models.sd3 import from_diffusers, weight_map

    torch.set_num_threads(1)
    model = tiny.diffusers_model(dcfg, seed=3)
    batches = tiny.sft_batches(dcfg, num_microbatches=2, batch=2, context_len=6)
    b = batches[0]
    with torch.no_grad():
        velocity = tiny.diffusers_velocity(model, tiny.noised(b), b["sigma"], b["encoder_hidden_states"],
                                           b["pooled_projections"])
    loss, grads = tiny.diffusers_sft_reference(model, batches)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads["pos_embed.pos_embed"] = state["pos_embed.pos_embed"]  # a buffer: mapped, then dropped
    ref_grads = weight_map.to_megatron_full(grads, from_diffusers(dcfg))
    ref_grads.pop("patch_embed.pos_embed")
    return dict(name=name, dcfg=dcfg, state=state, batches=batches, ref_velocities=[velocity],
                ref_loss=loss, ref_grads=ref_grads)


@pytest.mark.slow
@pytest.mark.dist
def test_layouts_match_diffusers_and_tp1(tmp_path):
    cases = [
        make_case("sd3", tiny.tiny_config()),
        make_case("sd35", tiny.tiny_config(qk_norm="rms_norm", dual_attention_layers=(0, 1))),
    ]
    torch.save(cases, tmp_path / "cases.pt")
    reports = run_multiprocess(sd3_workers.parity_rank, 4, str(tmp_path / "cases.pt"), LAYOUTS, timeout_s=900)
    common_workers.check_reports(reports, num_cases=len(cases), num_layouts=len(LAYOUTS))
