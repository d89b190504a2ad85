"""Rank functions for tests/models/test_wan_parallel.py and test_wan_model.py: the megatron Wan model at
several TP/SP/PP layouts inside one gloo launch, compared with diffusers (velocity, loss) and with the TP=1
megatron run (grads). The family-independent parts are in common_workers.py.

Module-level functions only: they are pickled by reference into the ranks. The ranks never import
diffusers (slow); the parent computes the diffusers reference and passes it in a file.
"""
from __future__ import annotations

import megaflow  # noqa: F401  (import guards before megatron)

from megaflow.trainer.runner import Trainer

import common_workers


def megatron_core_attention_spec(*, config, pp_rank, vp_stage):
    """Provider callable (dotted path): the local spec with megatron's own DotProductAttention in both attentions."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megaflow.models.wan.spec import get_wan_layer_spec

    return get_wan_layer_spec("local", core_attention=DotProductAttention)


def build_engine(dcfg: dict, layout: dict, *, seed: int = 1234) -> Trainer:
    """init_distributed for ``layout`` (ParallelDims kwargs, plus optional "spec") and a trainer."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return common_workers.build_engine("wan", dcfg, layout, seed=seed,
                                       ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))


def microbatches(batches: list[dict]) -> list[dict]:
    """Trainer microbatches (x_t [B, C, F, H, W], sigma, target, text states) from tiny.sft_batches."""
    from megaflow.trainer.runner import rectified_flow_microbatch

    out = []
    for b in batches:
        mb = rectified_flow_microbatch(b["x0"], b["noise"], b["sigma"], b["encoder_hidden_states"], None)
        del mb["pooled_projections"]  # Wan has no pooled text embedding
        out.append(mb)
    return out


def _run_layout(case: dict, layout: dict) -> tuple[dict, dict]:
    """One layout: velocities (forward only), SFT loss and full grads; (report entry, full grads)."""
    from megaflow.trainer.runner import rectified_flow_loss

    eng = build_engine(case["dcfg"], layout)
    eng.load_diffusers_state_dict(case["state"])
    mbs = microbatches(case["batches"])
    velocities = eng.forward_backward(mbs, None, forward_only=True)
    results = eng.forward_backward(mbs, rectified_flow_loss)
    grads = dict(eng.iter_full_grads())
    return common_workers.layout_entry(velocities, results, case), grads


def parity_rank(cases_path: str, layouts: list[dict]) -> dict:
    """``common_workers.parity_rank`` for Wan (errors per (case, layout), iter_full_params exact)."""
    return common_workers.parity_rank("wan", cases_path, layouts, _run_layout, build_engine)
