"""megatron Wan vs diffusers WanTransformer3DModel across parallel layouts, on video latents.

Needs: CPU, gloo, 4 processes (ONE launch runs every layout). Tiny config (2 blocks, 4 heads x 8), random fp32
weights, latents [2, 4, 3, 4, 6] (3 latent frames: 3 x 2 x 3 = 18 video tokens), 6 text tokens.
Layouts: TP=1 (reference; DP=4), TP=2, TP=2+SP (video and text tokens split over the ranks), PP=2 (one block
per stage, the packed [video; text; temb; 6 time-projection rows] crossing the stage boundary), TP2xPP2+SP
(sequence-parallel shards of both token streams in that packed tensor).
Tolerances: velocity and loss vs diffusers <= 1e-5 abs and <= 1e-5 relative to the velocity's largest value;
full grads vs the TP=1 megatron run <= 1e-6 (abs); TP=1 grads vs diffusers grads <= 1e-5.
"""
from __future__ import annotations

import pytest
import torch

from megaflow.models.wan import tiny
from megaflow.testing.dist import run_multiprocess

import common_workers
import wan_workers

LAYOUTS = [dict(tp=2), dict(tp=2, sp=True), dict(pp=2), dict(tp=2, pp=2, sp=True)]
REL_TOL = 1e-5


def make_case(name: str, dcfg: dict, **batch_kwargs) -> dict:
    """Diffusers reference: velocities of both microbatches (``tiny.sft_batches(dcfg, **batch_kwargs)``), SFT
    loss and grads (megatron names)."""
    from megaflow.models.wan import from_diffusers, weight_map

    torch.set_num_threads(1)
    model = tiny.diffusers_model(dcfg, seed=3)
    batches = tiny.sft_batches(dcfg, num_microbatches=2, batch=2, **batch_kwargs)
    with torch.no_grad():
        velocities = [tiny.diffusers_velocity(model, b) for b in batches]
    loss, grads = tiny.diffusers_sft_reference(model, batches)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref_grads = weight_map.to_megatron_full(grads, from_diffusers(dcfg))
    return dict(name=name, dcfg=dcfg, state=state, batches=batches, ref_velocities=velocities,
                ref_loss=loss, ref_grads=ref_grads)


def check_relative(reports: list[dict], cases: list[dict]) -> None:
    """Every velocity error within ``REL_TOL`` of its case's largest reference velocity."""
    scale = {c["name"]: max(float(v.abs().max()) for v in c["ref_velocities"]) for c in cases}
    for report in reports:
        for (name, layout), entry in report.items():
            if isinstance(entry, dict) and "out_err" in entry:
                assert entry["out_err"] <= REL_TOL * scale[name], (name, layout, entry, scale[name])


@pytest.mark.slow
@pytest.mark.dist
def test_layouts_match_diffusers_and_tp1(tmp_path):
    cases = [make_case("t2v", tiny.tiny_config())]
    torch.save(cases, tmp_path / "cases.pt")
    reports = run_multiprocess(wan_workers.parity_rank, 4, str(tmp_path / "cases.pt"), LAYOUTS, timeout_s=600)
    common_workers.check_reports(reports, num_cases=len(cases), num_layouts=len(LAYOUTS))
    check_relative(reports, cases)
