"""Rank functions for tests/models: the megatron SD3 MMDiT at several TP/SP/PP/VPP layouts inside
one gloo launch, compared with diffusers (outputs, loss) and with the TP=1 megatron run (grads).

Module-level functions only: they are pickled by reference into the ranks. The ranks never import
diffusers (slow); the parent computes the diffusers reference and passes it in.
"""
from __future__ import annotations

import megaflow  # noqa: F401  (import guards before megatron)
import torch

from megaflow.parallel import ParallelDims, destroy_distributed, init_distributed


def megatron_core_attention_spec(*, config, pp_rank, vp_stage):
    """Provider callable (dotted path): the local spec with megatron's own DotProductAttention."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megaflow.models.sd3.spec import get_mmdit_layer_spec

    return get_mmdit_layer_spec("local", core_attention=DotProductAttention)


def whole_model_provider(*, config, pp_rank, vp_stage):
    """Provider callable (dotted path) that returns a whole model chunk instead of a spec."""
    from megaflow.models.sd3 import SD3MMDiT, get_mmdit_layer_spec

    return SD3MMDiT(config, get_mmdit_layer_spec("local"), pp_rank=pp_rank, vp_stage=vp_stage)


def build_engine(dcfg: dict, layout: dict, *, seed: int = 1234, optimizer_config=None, ddp_config=None):
    """init_distributed for ``layout`` (ParallelDims kwargs, plus optional "spec") and a TrainEngine."""
    from megaflow.models.sd3 import from_diffusers
    from megaflow.trainer.engine import TrainEngine

    layout = dict(layout)
    spec = layout.pop("spec", "local")
    dims = ParallelDims(**layout)
    init_distributed(dims, seed=seed)
    cfg = from_diffusers(
        dcfg, tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp, sequence_parallel=dims.sp,
    )
    return TrainEngine(cfg, spec=spec, optimizer_config=optimizer_config, ddp_config=ddp_config)


def microbatches(batches: list[dict]) -> list[dict]:
    from megaflow.trainer.engine import rectified_flow_microbatch

    return [rectified_flow_microbatch(b["x0"], b["noise"], b["sigma"], b["encoder_hidden_states"],
                                      b["pooled_projections"]) for b in batches]


def _max_abs(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:3]
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _run_layout(case: dict, layout: dict) -> tuple[dict, dict]:
    """One layout: velocity, SFT loss and full grads; returns (report entry, full grads)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallelConfig

    eng = build_engine(case["dcfg"], layout, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    eng.load_diffusers_state_dict(case["state"])
    mbs = microbatches(case["batches"])
    v = eng.velocity(mbs[0]["latents"], mbs[0]["sigma"], mbs[0]["encoder_hidden_states"], mbs[0]["pooled_projections"])
    from megaflow.trainer.engine import rectified_flow_loss

    results = eng.forward_backward(mbs, rectified_flow_loss)
    grads = dict(eng.iter_full_grads())
    entry = {"last_stage": ps.is_pipeline_last_stage(ignore_virtual=True)}
    if v is not None:
        entry["out_err"] = float((v - case["ref_velocity"]).abs().max())
        loss = float(sum(r["loss"] for r in results) / len(results))
        entry["loss_err"] = abs(loss - case["ref_loss"])
    return entry, grads


def parity_rank(cases_path: str, layouts: list[dict]) -> dict:
    """For each case: TP=1 first (reference grads), then every layout; errors per (case, layout).

    ``cases_path``: a torch.save'd list of cases (tensors as args would be passed as fds, too many
    for multiprocessing). Also checks that ``iter_full_params`` at the last layout returns exactly
    the loaded weights."""
    from megaflow.models.sd3 import from_diffusers, weight_map

    cases = torch.load(cases_path, weights_only=False)
    report = {}
    for case in cases:
        ref_entry, ref_grads = _run_layout(case, {})
        ref_entry["grad_err_vs_diffusers"] = _max_abs(ref_grads, case["ref_grads"])
        report[(case["name"], "tp1")] = ref_entry
        for layout in layouts:
            entry, grads = _run_layout(case, layout)
            entry["grad_err"] = _max_abs(grads, ref_grads)
            entry["grad_scale"] = max(float(g.abs().max()) for g in ref_grads.values())
            report[(case["name"], str(layout))] = entry
        eng = build_engine(case["dcfg"], layouts[-1])
        eng.load_diffusers_state_dict(case["state"])
        expected = weight_map.to_megatron_full(case["state"], from_diffusers(case["dcfg"]))
        got = dict(eng.iter_full_params())
        report[(case["name"], "iter_full_params_exact")] = got.keys() == expected.keys() and all(
            torch.equal(got[k], expected[k]) for k in expected)
    destroy_distributed()
    return report
