"""Rank functions for tests/models (SD3): the megatron SD3 MMDiT at several TP/SP/PP/VPP layouts
inside one gloo launch, compared with diffusers (outputs, loss) and with the TP=1 megatron run
(grads). The family-independent parts are in common_workers.py.

Module-level functions only: they are pickled by reference into the ranks. The ranks never import
diffusers (slow); the parent computes the diffusers reference and passes it in.
"""
from __future__ import annotations

import megaflow  # noqa: F401  (import guards before megatron)

import common_workers


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
    """init_distributed for ``layout`` (ParallelDims kwargs, plus optional "spec") and a Trainer."""
    return common_workers.build_engine("sd3", dcfg, layout, seed=seed, optimizer_config=optimizer_config,
                                       ddp_config=ddp_config)


def microbatches(batches: list[dict]) -> list[dict]:
    from megaflow.trainer.runner import rectified_flow_microbatch

    return [rectified_flow_microbatch(b["x0"], b["noise"], b["sigma"], b["encoder_hidden_states"],
                                      b["pooled_projections"]) for b in batches]


def _run_layout(case: dict, layout: dict) -> tuple[dict, dict]:
    """One layout: velocity on microbatch 0, SFT loss and full grads; (report entry, full grads)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from megaflow.trainer.runner import rectified_flow_loss

    eng = build_engine(case["dcfg"], layout, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
    eng.load_diffusers_state_dict(case["state"])
    mbs = microbatches(case["batches"])
    v = eng.velocity(mbs[0]["latents"], mbs[0]["sigma"], mbs[0]["encoder_hidden_states"], mbs[0]["pooled_projections"])
    results = eng.forward_backward(mbs, rectified_flow_loss)
    grads = dict(eng.iter_full_grads())
    return common_workers.layout_entry([] if v is None else [v], results, case), grads


def parity_rank(cases_path: str, layouts: list[dict]) -> dict:
    """``common_workers.parity_rank`` for SD3 (errors per (case, layout), iter_full_params exact)."""
    return common_workers.parity_rank("sd3", cases_path, layouts, _run_layout, build_engine)
