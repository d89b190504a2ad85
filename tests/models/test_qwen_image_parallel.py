"""megatron Qwen-Image vs diffusers QwenImageTransformer2DModel across parallel layouts.

Needs: CPU, gloo, 4 processes (ONE launch runs every layout), diffusers in the parent only.
Case: tiny config (2 blocks, hidden 32), random fp32 weights, a 3x4 latent grid (odd height: the centred
RoPE grid), two prompts of 5 and 7 text tokens in one batch (padded to 7 with noise, masked).
Layouts: TP=1 (reference; DP=4), TP=2+SP (7 text tokens: the model pads the text to 8 and masks it),
PP=2, TP=2 with megatron's own DotProductAttention (padding mask) via a dotted-path spec provider,
TP2xPP2+SP (the padded, sequence-parallel text in the p2p tensor).
Tolerances: velocity and loss vs diffusers <= 1e-5 abs, velocity also <= 1e-5 relative to the largest
reference velocity; full grads vs the TP=1 megatron run <= 1e-6; TP=1 grads vs diffusers grads <= 1e-5;
each prompt alone (no padding, no mask) vs its row of the padded batch <= 1e-5 at every layout.
"""
from __future__ import annotations

import pytest
import torch

from megaflow.models.qwen_image import tiny
from megaflow.testing.dist import run_multiprocess

import common_workers
import qwen_image_workers

LAYOUTS = [dict(tp=2, sp=True), dict(pp=2), dict(tp=2, spec="qwen_image_workers:megatron_core_attention_spec"),
           dict(tp=2, pp=2, sp=True)]


def make_case(name: str, dcfg: dict) -> dict:
    """Diffusers reference: velocities of both microbatches, SFT loss and grads (megatron names)."""
    from megaflow.models.qwen_image import from_diffusers, weight_map

    torch.set_num_threads(1)
    model = tiny.diffusers_model(dcfg, seed=3)
    batches = tiny.sft_batches(dcfg, num_microbatches=2)
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
    cases = [make_case("qwen_image", tiny.tiny_config())]
    torch.save(cases, tmp_path / "cases.pt")
    reports = run_multiprocess(qwen_image_workers.parity_rank, 4, str(tmp_path / "cases.pt"), LAYOUTS, timeout_s=600)
    common_workers.check_reports(reports, num_cases=len(cases), num_layouts=len(LAYOUTS))
    scale = max(float(v.abs().max()) for v in cases[0]["ref_velocities"])
    out = [e["out_err"] for r in reports for e in r.values() if isinstance(e, dict) and "out_err" in e]
    assert max(out) <= 1e-5 * scale, (max(out), scale)
    padding = [e["padding_err"] for r in reports for e in r.values() if isinstance(e, dict) and "padding_err" in e]
    assert len(padding) >= len(LAYOUTS) + 1 and max(padding) <= common_workers.OUT_TOL, padding
