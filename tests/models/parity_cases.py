"""Parent side of every family's parity test (test_parallel_parity.py, test_sd3_model.py, test_wan_model.py): the
diffusers reference of a case (velocity, SFT loss and grads mapped to megatron names, on random fp32 weights of the
family's tiny config) and the checks of what the ranks (parity_workers.py) report about it.

Tolerances (abs) of every parity test: velocity and loss vs diffusers OUT_TOL, and velocity also within OUT_TOL of
the largest reference velocity where ``relative`` is asked; full grads vs the TP=1 megatron run GRAD_TOL (grads are
O(0.1-1)); TP=1 grads vs diffusers grads GRAD_VS_DIFFUSERS_TOL.
"""
from __future__ import annotations

import importlib

import torch

OUT_TOL, GRAD_TOL, GRAD_VS_DIFFUSERS_TOL = 1e-5, 1e-6, 1e-5
# tiny.sft_batches arguments: 2 microbatches of 2 samples, 6 text tokens (Qwen-Image: its own prompts of 5 and 7)
BATCHES = {"sd3": dict(batch=2, context_len=6), "flux": dict(batch=2, context_len=6), "qwen_image": {},
           "wan": dict(batch=2)}


def make_case(family: str, name: str, dcfg: dict, layouts: list[dict], **batch_kwargs) -> dict:
    """A case the ranks run at TP=1 and at each of ``layouts``: diffusers' velocities (SD3: of microbatch 0 only, the
    one ``Trainer.velocity`` computes), SFT loss and grads (megatron names) on ``tiny.sft_batches(dcfg,
    **batch_kwargs)``."""
    package = importlib.import_module(f"megaflow.models.{family}")
    tiny = importlib.import_module(f"megaflow.models.{family}.tiny")
    torch.set_num_threads(1)
    model = tiny.diffusers_model(dcfg, seed=3)
    batches = tiny.sft_batches(dcfg, num_microbatches=2, **{**BATCHES[family], **batch_kwargs})
    with torch.no_grad():
        if family == "sd3":
            b = batches[0]
            velocities = [tiny.diffusers_velocity(model, tiny.noised(b), b["sigma"], b["encoder_hidden_states"],
                                                  b["pooled_projections"])]
        else:
            velocities = [tiny.diffusers_velocity(model, b) for b in batches]
    loss, grads = tiny.diffusers_sft_reference(model, batches)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if family == "sd3":
        grads["pos_embed.pos_embed"] = state["pos_embed.pos_embed"]  # a buffer: mapped, then dropped
    ref_grads = package.weight_map.to_megatron_full(grads, package.from_diffusers(dcfg))
    if family == "sd3":
        ref_grads.pop("patch_embed.pos_embed")
    return dict(family=family, name=name, dcfg=dcfg, layouts=layouts, state=state, batches=batches,
                ref_velocities=velocities, ref_loss=loss, ref_grads=ref_grads)


def _entries(reports: list[dict], cases: list[dict]):
    """(rank, (case name, layout), entry) of ``cases`` over every rank's report."""
    names = {c["name"] for c in cases}
    for rank, report in enumerate(reports):
        for key, entry in report.items():
            if key[0] in names:
                yield rank, key, entry


def check_reports(reports: list[dict], cases: list[dict], *, relative: bool = False) -> None:
    """Every rank's entries of ``cases`` within the tolerances (``relative``: the velocity error also within OUT_TOL
    of the case's largest reference velocity), ``iter_full_params`` exact, and a last-stage velocity for every
    (case, layout) including the TP=1 reference."""
    scale = {c["name"]: max(float(v.abs().max()) for v in c["ref_velocities"]) for c in cases}
    for rank, key, entry in _entries(reports, cases):
        if key[1] == "iter_full_params_exact":
            assert entry is True, (rank, key)
            continue
        print(rank, key, entry)
        if "out_err" in entry:
            assert entry["out_err"] <= OUT_TOL, (rank, key, entry)
            assert entry["loss_err"] <= OUT_TOL, (rank, key, entry)
            assert not relative or entry["out_err"] <= OUT_TOL * scale[key[0]], (rank, key, entry, scale[key[0]])
        if "grad_err" in entry:
            assert entry["grad_err"] <= GRAD_TOL, (rank, key, entry)
        if "grad_err_vs_diffusers" in entry:
            assert entry["grad_err_vs_diffusers"] <= GRAD_VS_DIFFUSERS_TOL, (rank, key, entry)
    last = {key for _, key, e in _entries(reports, cases) if isinstance(e, dict) and "out_err" in e}
    assert len(last) == sum(len(c["layouts"]) + 1 for c in cases), sorted(last)
    assert sum(1 for _, key, _ in _entries(reports, cases) if key[1] == "iter_full_params_exact") == \
        len(cases) * len(reports)
