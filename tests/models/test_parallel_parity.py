"""Each family's megatron model vs its diffusers transformer across parallel layouts: SD3 MMDiT, FLUX.1, Qwen-Image
and Wan, random fp32 weights of tiny configs. ONE gloo launch of 4 processes runs every case of every family at
TP=1 (the reference; DP=4) and at each of its layouts (module fixture; diffusers in the parent only); each test
checks its family's entries.

Tolerances (parity_cases.py): velocity and loss vs diffusers <= 1e-5 (abs); full grads vs the TP=1 megatron run
<= 1e-6 (abs; grads are O(0.1-1)); TP=1 grads vs diffusers grads <= 1e-5; ``iter_full_params`` at the last layout
returns exactly the loaded weights. Needs: CPU, gloo, 4 processes.
"""
from __future__ import annotations

import pytest
import torch

from megaflow.testing.dist import run_multiprocess

import parity_workers
from parity_cases import OUT_TOL, check_reports, make_case

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def _spec(family: str) -> dict:
    """TP=2 with megatron's own DotProductAttention through a dotted-path spec provider."""
    return dict(tp=2, spec=f"parity_workers:{family}_core_attention_spec")


def _cases() -> dict[str, list[dict]]:
    from megaflow.models.flux import tiny as flux
    from megaflow.models.qwen_image import tiny as qwen_image
    from megaflow.models.sd3 import tiny as sd3
    from megaflow.models.wan import tiny as wan

    sd3_layouts = [dict(tp=2), dict(tp=2, sp=True), dict(pp=2), dict(pp=2, vpp=2), dict(tp=2, pp=2),
                   dict(tp=2, pp=2, sp=True), _spec("sd3")]
    flux_layouts = [dict(tp=2), dict(tp=2, sp=True), dict(pp=2), dict(pp=2, vpp=2), _spec("flux"),
                    dict(tp=2, pp=2, sp=True)]
    return {
        "sd3": [make_case("sd3", "sd3", sd3.tiny_config(), sd3_layouts),
                make_case("sd3", "sd35", sd3.tiny_config(qk_norm="rms_norm", dual_attention_layers=(0, 1)),
                          sd3_layouts)],
        "flux": [make_case("flux", "dev", flux.tiny_config(guidance_embeds=True), flux_layouts),
                 make_case("flux", "schnell", flux.tiny_config(guidance_embeds=False), flux_layouts)],
        "qwen_image": [make_case("qwen_image", "qwen_image", qwen_image.tiny_config(),
                                 [dict(tp=2, sp=True), dict(pp=2), _spec("qwen_image"), dict(tp=2, pp=2, sp=True)])],
        "wan": [make_case("wan", "t2v", wan.tiny_config(),
                          [dict(tp=2), dict(tp=2, sp=True), dict(pp=2), dict(tp=2, pp=2, sp=True)])],
    }


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> tuple[dict[str, list[dict]], list[dict]]:
    """(the cases by family, every rank's report) of the one launch."""
    cases = _cases()
    path = tmp_path_factory.mktemp("parity") / "cases.pt"
    torch.save([c for family in cases.values() for c in family], path)
    return cases, run_multiprocess(parity_workers.parity_rank, 4, str(path), timeout_s=1800)


def test_sd3_layouts_match_diffusers_and_tp1(parity):
    """SD3 (no q/k norm) and SD3.5-medium-like (qk_norm="rms_norm" + dual attention blocks). Layouts: TP=2, TP=2+SP,
    PP=2, PP=2xVPP=2, TP2xPP2, TP2xPP2+SP, TP=2 with megatron's own DotProductAttention."""
    cases, reports = parity
    check_reports(reports, cases["sd3"])


def test_flux_layouts_match_diffusers_and_tp1(parity):
    """FLUX.1-dev-like (guidance embedding) and FLUX.1-schnell-like (none); 2 double + 2 single blocks, random
    txt_ids so the context RoPE is exercised. Layouts: TP=2, TP=2+SP, PP=2, PP=2xVPP=2 (one block per chunk), TP=2
    with megatron's own DotProductAttention, TP2xPP2+SP (the stage boundary is the double -> single switch, with
    sequence-parallel shards in the p2p tensor)."""
    cases, reports = parity
    check_reports(reports, cases["flux"])


def test_qwen_image_layouts_match_diffusers_and_tp1(parity):
    """2 blocks, hidden 32, a 3x4 latent grid (odd height: the centred RoPE grid), two prompts of 5 and 7 text
    tokens in one batch (padded to 7 with noise, masked). Layouts: TP=2+SP (7 text tokens: the model pads the text
    to 8 and masks it), PP=2, TP=2 with megatron's own DotProductAttention (padding mask), TP2xPP2+SP (the padded,
    sequence-parallel text in the p2p tensor). Also: velocity within 1e-5 of the largest reference velocity, and
    each prompt alone (no padding, no mask) vs its row of the padded batch <= 1e-5 at every layout."""
    cases, reports = parity
    check_reports(reports, cases["qwen_image"], relative=True)
    padding = [e["padding_err"] for r in reports for (name, _), e in r.items()
               if name == "qwen_image" and isinstance(e, dict) and "padding_err" in e]
    assert len(padding) >= len(cases["qwen_image"][0]["layouts"]) + 1 and max(padding) <= OUT_TOL, padding


def test_wan_layouts_match_diffusers_and_tp1(parity):
    """Video latents [2, 4, 3, 4, 6] (3 latent frames: 3 x 2 x 3 = 18 video tokens), 6 text tokens; 2 blocks, 4 heads
    x 8. Layouts: TP=2, TP=2+SP (video and text tokens split over the ranks), PP=2 (one block per stage, the packed
    [video; text; temb; 6 time-projection rows] crossing the stage boundary), TP2xPP2+SP (sequence-parallel shards of
    both token streams in that packed tensor). Also: velocity within 1e-5 of its largest value."""
    cases, reports = parity
    check_reports(reports, cases["wan"], relative=True)
