"""Rank function for tests/parallel/test_perf_patches.py: for every performance patch in
``megaflow.parallel.perf_patches.PERF_PATCHES``, whether the slow megatron path it replaces is still there
(``needed``) and whether the patched path gives exactly the same results (``identical``).
"""
from __future__ import annotations

import collections
import contextlib

import megaflow  # noqa: F401  (import guards before megatron)
import torch

from megaflow.parallel.dims import ParallelDims
from megaflow.parallel.distributed import destroy_distributed, init_distributed
from megaflow.parallel import perf_patches


@contextlib.contextmanager
def _only(name: str | None):
    """Exactly one performance patch applied (or none) while active."""
    perf_patches.remove_perf_patches()
    if name is not None:
        perf_patches.apply_perf_patches(skip=set(perf_patches.PERF_PATCHES) - {name})
    try:
        yield
    finally:
        perf_patches.remove_perf_patches()


@contextlib.contextmanager
def _counting(owner, attr: str):
    """Counts calls of ``owner.attr`` (a function or a class method) while active."""
    counts = collections.Counter()
    original = owner.__dict__[attr]

    def call(*args, **kwargs):
        counts["calls"] += 1
        return original(*args, **kwargs)

    setattr(owner, attr, call)
    try:
        yield counts
    finally:
        setattr(owner, attr, original)


def _grads(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = []
    for shape in [(64, 32), (32,), (3, 5, 7), (1,), (128, 16)]:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=g)
        params.append(p)
    return params


def _norm_and_clip(name: str | None) -> tuple[float, list[torch.Tensor]]:
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import clip_grads

    params = _grads(seed=0)
    with _only(name):
        norm = clip_grads.get_grad_norm_fp32([p.grad for p in params],
                                             grad_stats_parallel_group=ps.get_model_parallel_group())
        clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=norm)
    return norm, [p.grad for p in params]


def check_foreach_grad_norm() -> dict:
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads

    with _only(None):
        needed = (clip_grads.l2_norm_impl is mutils.local_multi_tensor_l2_norm
                  and clip_grads.multi_tensor_scale_impl is mutils.local_multi_tensor_scale)
    (n0, g0), (n1, g1) = _norm_and_clip(None), _norm_and_clip("foreach_grad_norm")
    return {"needed": needed, "identical": n0 == n1 and n0 > 1.0 and all(map(torch.equal, g0, g1))}


def check_size1_grad_norm_allreduce() -> dict:
    calls = {}
    for name in (None, "size1_grad_norm_allreduce"):
        with _counting(torch.distributed, "all_reduce") as counts:
            calls[name] = (_norm_and_clip(name), counts["calls"])
    (r0, c0), (r1, c1) = calls[None], calls["size1_grad_norm_allreduce"]
    return {"needed": c0 >= 1 and c1 == 0,
            "identical": r0[0] == r1[0] and all(map(torch.equal, r0[1], r1[1]))}


def _tp1_linears_run(name: str | None) -> list[torch.Tensor]:
    """megatron's column- then row-parallel linear at TP=1: output and all grads."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                            gradient_accumulation_fusion=False)
    torch.manual_seed(0)
    col = tensor_parallel.ColumnParallelLinear(8, 16, config=cfg, init_method=torch.nn.init.normal_, bias=True,
                                               gather_output=False)
    row = tensor_parallel.RowParallelLinear(16, 8, config=cfg, init_method=torch.nn.init.normal_, bias=True,
                                            input_is_parallel=True, skip_bias_add=False)
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with _only(name):
        out = row(col(x)[0])[0]
        out.square().sum().backward()
    return [out.detach(), x.grad, *(p.grad for p in (*col.parameters(), *row.parameters()))]


def check_tp1_identity_mappings() -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import layers

    x = torch.randn(3, requires_grad=True)
    group = ps.get_tensor_model_parallel_group()
    with _only(None):
        fns = [type(layers.copy_to_tensor_model_parallel_region(x, group=group).grad_fn).__name__,
               type(layers.reduce_from_tensor_model_parallel_region(x, group=group).grad_fn).__name__]
    with _only("tp1_identity_mappings"):
        same = (layers.copy_to_tensor_model_parallel_region(x, group=group) is x
                and layers.reduce_from_tensor_model_parallel_region(x, group=group) is x)
    needed = "CopyToModelParallelRegion" in fns[0] and "ReduceFromModelParallelRegion" in fns[1]
    a, b = _tp1_linears_run(None), _tp1_linears_run("tp1_identity_mappings")
    return {"needed": needed and same, "identical": all(map(torch.equal, a, b))}


def check_dtensor_passthrough() -> dict:
    from megatron.core.optimizer import clip_grads

    x = torch.randn(4)
    entered = {}
    for name in (None, "dtensor_passthrough"):
        with _only(name), _counting(torch.no_grad, "__enter__") as counts:
            out = clip_grads.to_local_if_dtensor(x)
        entered[name] = (out is x, counts["calls"])
    (same0, n0), (same1, n1) = entered[None], entered["dtensor_passthrough"]
    return {"needed": n0 >= 1 and n1 == 0, "identical": same0 and same1}


def perf_patch_checks_rank(names: list[str]) -> dict:
    """{patch: {"needed": bool, "identical": bool}} plus ``_restored``."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.tensor_parallel import layers, mappings

    init_distributed(ParallelDims(), seed=5)
    report = {name: globals()[f"check_{name}"]() for name in names}
    perf_patches.apply_perf_patches()
    perf_patches.remove_perf_patches()
    report["_restored"] = (
        not perf_patches.applied_perf_patches()
        and layers.copy_to_tensor_model_parallel_region is mappings.copy_to_tensor_model_parallel_region
        and clip_grads.torch.distributed is torch.distributed
        and clip_grads.to_local_if_dtensor.__module__ == "megatron.core.utils"
    )
    destroy_distributed()
    return report
