"""Rank functions for tests/models/test_recompute.py: the same SFT forward + backward with and without
activation recompute (megatron's recompute fields on the DiT config), per family and parallel layout,
and the activation memory of both on one process.

Module-level functions only: they are pickled by reference into the ranks.
"""
from __future__ import annotations

import functools

import megaflow  # noqa: F401  (import guards before megatron)

import torch

from megaflow.parallel.dims import ParallelDims
from megaflow.parallel.distributed import destroy_distributed, init_distributed

RECOMPUTE = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "block1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
}


def _engine(family: str, dcfg: dict, layout: dict, recompute: str):
    from megatron.core.distributed import DistributedDataParallelConfig

    from megaflow.models.registry import get_family
    from megaflow.trainer.runner import Trainer

    dims = ParallelDims(**layout)
    init_distributed(dims, seed=1234)
    cfg = get_family(family).config_from_diffusers(
        dcfg, tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp,
        sequence_parallel=dims.sp, **RECOMPUTE[recompute])
    return Trainer(cfg, family=family, spec="local",
                   ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))


def _microbatches(batches: list[dict]) -> list[dict]:
    from megaflow.trainer.runner import rectified_flow_microbatch

    out = []
    for b in batches:
        mb = rectified_flow_microbatch(b["x0"], b["noise"], b["sigma"], b["encoder_hidden_states"],
                                       b["pooled_projections"])
        mb.update({k: b[k] for k in ("txt_ids", "img_ids", "guidance") if k in b})
        out.append(mb)
    return out


def _grads(case: dict, layout: dict, recompute: str) -> tuple[list[float], dict]:
    from megaflow.trainer.runner import rectified_flow_loss

    eng = _engine(case["family"], case["dcfg"], layout, recompute)
    eng.load_diffusers_state_dict(case["state"])
    results = eng.forward_backward(_microbatches(case["batches"]), rectified_flow_loss)
    grads = {k: v.clone() for k, v in eng.iter_full_grads()}
    return [float(r["loss"]) for r in results], grads


def grads_rank(cases_path: str, layouts: list[dict]) -> dict:
    """Per (case, layout, recompute mode): the largest |grad - grad without recompute| and |loss - loss
    without| (losses only where this rank is on the last stage), and the grad scale."""
    cases = torch.load(cases_path, weights_only=False)
    report = {}
    for case in cases:
        for layout in layouts:
            base_loss, base = _grads(case, layout, "none")
            for mode in case["modes"]:
                loss, grads = _grads(case, layout, mode)
                report[(case["name"], str(layout), mode)] = dict(
                    grad_err=max(float((grads[k] - base[k]).abs().max()) for k in base),
                    loss_err=max((abs(a - b) for a, b in zip(loss, base_loss)), default=0.0),
                    grad_scale=max(float(g.abs().max()) for g in base.values()), same_keys=grads.keys() == base.keys())
    destroy_distributed()
    return report


def _forward_only(eng, microbatch: dict):
    """The first chunk's forward graph on one microbatch (what autograd saves for backward)."""
    return eng.model[0](**eng.family.model_inputs(eng.config, microbatch))


def memory_rank(case_path: str) -> dict:
    """One process: peak RSS above the start and autograd's saved bytes of one forward + backward
    (``megaflow.testing.memory``), without recompute, with it, and without it again (to show the
    measurement does not drift), the model's parameter bytes, and the largest grad difference between
    the runs with and without recompute (one process: the single-rank DDP fast path)."""
    from megaflow.testing.memory import malloc_returns_memory, peak_rss, saved_tensor_bytes
    from megaflow.trainer.runner import rectified_flow_loss

    malloc_returns_memory()
    case = torch.load(case_path, weights_only=False)
    out, grads = {}, {}
    for label, mode in (("none", "none"), ("full", "full"), ("none_again", "none")):
        eng = _engine(case["family"], case["dcfg"], {}, mode)
        eng.load_diffusers_state_dict(case["state"])
        mbs = _microbatches(case["batches"])
        params = [p for c in eng.chunks for p in c.parameters()]
        eng.forward_backward(mbs, rectified_flow_loss)  # warm-up (lazy allocations, grad tensors)
        _, peak = peak_rss(functools.partial(eng.forward_backward, mbs, rectified_flow_loss))

        _, saved = saved_tensor_bytes(functools.partial(_forward_only, eng, mbs[0]), exclude=params)
        out[label] = dict(peak_rss=peak, saved=saved, param_bytes=sum(p.numel() * p.element_size() for p in params))
        grads[label] = {k: v.clone() for k, v in eng.iter_full_grads()}
        del eng, mbs, params
    out["grad_err"] = max(float((grads["full"][k] - grads["none"][k]).abs().max()) for k in grads["none"])
    destroy_distributed()
    return out
