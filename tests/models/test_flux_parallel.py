"""megatron FLUX.1 vs diffusers FluxTransformer2DModel across parallel layouts.

Needs: CPU, gloo, 4 processes (ONE launch runs every case and layout), diffusers in the parent only.
Cases: FLUX.1-dev-like (guidance embedding) and FLUX.1-schnell-like (none); tiny config (2 double +
2 single blocks), random fp32 weights, random txt_ids so the context RoPE is exercised.
Layouts: TP=1 (reference; DP=4), TP=2, TP=2+SP, PP=2, PP=2xVPP=2 (one block per chunk), TP=2 with
megatron's own DotProductAttention via a dotted-path spec provider, TP2xPP2+SP (the stage boundary
is the double -> single switch, with sequence-parallel shards in the p2p tensor).
Tolerances: velocity and loss vs diffusers <= 1e-5 (abs); full grads vs the TP=1 megatron run
<= 1e-6 (abs; grads are O(0.1-1)); TP=1 grads vs diffusers grads <= 1e-5.
"""
from __future__ import annotations

import pytest
import torch

from megaflow.models.flux import tiny
from megaflow.testing.dist import run_multiprocess

import common_workers
import flux_workers

LAYOUTS = [
    dict(tp=2), dict(tp=2, sp=True), dict(pp=2), dict(pp=2, vpp=2),
    dict(tp=2, spec="flux_workers:megatron_core_attention_spec"), dict(tp=2, pp=2, sp=True),
]


def make_case(name: str, dcfg: dict) -> dict:
    """Diffusers reference: velocities of both microbatches, SFT loss and grads (megatron names)."""
    from megaflow.models.flux import from_diffusers, weight_map

    torch.set_num_threads(1)
    model = tiny.diffusers_model(dcfg, seed=3)
    batches = tiny.sft_batches(dcfg, num_microbatches=2, batch=2, context_len=6)
    with torch.no_grad():
        velocities = [tiny.diffusers_velocity(model, b) for b in batches]
    loss, grads = tiny.diffusers_sft_reference(model, batches)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref_grads = weight_map.to_megatron_full(grads, from_diffusers(dcfg))
    return dict(name=name, dcfg=dcfg, state=state, batches=batches, ref_velocities=velocities,
                ref_loss=loss, ref_grads=ref_grads)


@pytest.mark.slow
@pytest.mark.dist
def test_layouts_match_diffusers_and_tp1(tmp_path):
    cases = [
        make_case("dev", tiny.tiny_config(guidance_embeds=True)),
        make_case("schnell", tiny.tiny_config(guidance_embeds=False)),
    ]
    torch.save(cases, tmp_path / "cases.pt")
    reports = run_multiprocess(flux_workers.parity_rank, 4, str(tmp_path / "cases.pt"), LAYOUTS, timeout_s=600)
    common_workers.check_reports(reports, num_cases=len(cases), num_layouts=len(LAYOUTS))
