"""Rank functions and report checks shared by the family parity tests (tests/models/*_workers.py,
test_*_parallel.py): a family's megatron model at several TP/SP/PP/VPP layouts inside one gloo
launch, compared with diffusers (velocity, loss) and with the TP=1 megatron run (grads).

Module-level functions only: the family workers call them inside the ranks. The ranks never
import diffusers (slow); the parent computes the diffusers reference and passes it in a file.
"""
from __future__ import annotations

from typing import Callable

import megaflow  # noqa: F401  (import guards before megatron)
import torch

from megaflow.parallel.dims import ParallelDims
from megaflow.parallel.distributed import destroy_distributed, init_distributed

# Tolerances (abs) of every parity test: velocity and loss vs diffusers, full grads vs the TP=1
# megatron run (grads are O(0.1-1)), TP=1 grads vs diffusers grads.
OUT_TOL, GRAD_TOL, GRAD_VS_DIFFUSERS_TOL = 1e-5, 1e-6, 1e-5


def build_engine(family: str, dcfg: dict, layout: dict, *, seed: int = 1234, engine_class=None, **engine_kwargs):
    """init_distributed for ``layout`` (ParallelDims kwargs, plus optional "spec", default
    "local") and a Trainer (or ``engine_class``) of ``family`` for diffusers config ``dcfg``."""
    from megaflow.models.registry import get_family
    from megaflow.trainer.runner import Trainer

    layout = dict(layout)
    spec = layout.pop("spec", "local")
    dims = ParallelDims(**layout)
    init_distributed(dims, seed=seed)
    cfg = get_family(family).config_from_diffusers(
        dcfg, tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp, sequence_parallel=dims.sp,
    )
    return (engine_class or Trainer)(cfg, family=family, spec=spec, **engine_kwargs)


def max_abs(a: dict, b: dict) -> float:
    """Largest absolute difference between two dicts of tensors with the same keys."""
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:3]
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def layout_entry(velocities: list[torch.Tensor], results: list[dict], case: dict) -> dict:
    """One layout's report entry: whether this rank is on the last stage and, there, the largest
    velocity error vs ``case["ref_velocities"]`` and the mean SFT loss error vs ``case["ref_loss"]``."""
    from megatron.core import parallel_state as ps

    entry = {"last_stage": ps.is_pipeline_last_stage(ignore_virtual=True)}
    if velocities:
        entry["out_err"] = max(float((v - r).abs().max()) for v, r in zip(velocities, case["ref_velocities"]))
        loss = float(sum(r["loss"] for r in results) / len(results))
        entry["loss_err"] = abs(loss - case["ref_loss"])
    return entry


def parity_rank(family: str, cases_path: str, layouts: list[dict],
                run_layout: Callable[[dict, dict], tuple[dict, dict]], build: Callable[[dict, dict], object]) -> dict:
    """For each case: TP=1 first (reference grads), then every layout; errors per (case, layout).

    ``run_layout(case, layout) -> (report entry, full grads)``; ``build(dcfg, layout)`` -> the
    family's engine (for the ``iter_full_params`` check). ``cases_path``: a torch.save'd list
    of cases (tensors as args would be passed as fds, too many for multiprocessing). Also checks
    that ``iter_full_params`` at the last layout returns exactly the loaded weights (full tensors
    do not depend on the layout)."""
    from megaflow.models.registry import get_family

    fam = get_family(family)
    cases = torch.load(cases_path, weights_only=False)
    report = {}
    for case in cases:
        ref_entry, ref_grads = run_layout(case, {})
        ref_entry["grad_err_vs_diffusers"] = max_abs(ref_grads, case["ref_grads"])
        report[(case["name"], "tp1")] = ref_entry
        for layout in layouts:
            entry, grads = run_layout(case, layout)
            entry["grad_err"] = max_abs(grads, ref_grads)
            entry["grad_scale"] = max(float(g.abs().max()) for g in ref_grads.values())
            report[(case["name"], str(layout))] = entry
        eng = build(case["dcfg"], layouts[-1])
        eng.load_diffusers_state_dict(case["state"])
        expected = fam.weight_map.to_megatron_full(case["state"], fam.config_from_diffusers(case["dcfg"]))
        got = dict(eng.iter_full_params())
        report[(case["name"], "iter_full_params_exact")] = got.keys() == expected.keys() and all(
            torch.equal(got[k], expected[k]) for k in expected)
    destroy_distributed()
    return report


def check_reports(reports: list[dict], num_cases: int, num_layouts: int) -> None:
    """Parent side: every rank's entries within the tolerances, ``iter_full_params`` exact, and a
    last-stage velocity for every (case, layout) including the TP=1 reference."""
    for rank, report in enumerate(reports):
        for key, entry in report.items():
            if key[1] == "iter_full_params_exact":
                assert entry is True, (rank, key)
                continue
            print(rank, key, entry)
            if "out_err" in entry:
                assert entry["out_err"] <= OUT_TOL, (rank, key, entry)
                assert entry["loss_err"] <= OUT_TOL, (rank, key, entry)
            if "grad_err" in entry:
                assert entry["grad_err"] <= GRAD_TOL, (rank, key, entry)
            if "grad_err_vs_diffusers" in entry:
                assert entry["grad_err_vs_diffusers"] <= GRAD_VS_DIFFUSERS_TOL, (rank, key, entry)
    last = {key for report in reports for key, e in report.items() if isinstance(e, dict) and "out_err" in e}
    assert len(last) == num_cases * (num_layouts + 1)
