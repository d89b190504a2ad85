"""Rank function for tests/trainer/test_fast_paths.py (module-level: pickled by reference).

``fast_paths_rank`` runs in a one-process gloo world: the same two SFT steps (2 microbatches each)
on Trainers that differ only in their fast paths (all off = megatron's own code, all on, each
one alone), plus the checks that each single-rank fast path still replaces real megatron work.
"""
from __future__ import annotations

import collections
import contextlib

import megaflow  # noqa: F401  (import guards before megatron)
import torch

from megaflow.parallel.dims import ParallelDims
from megaflow.parallel.distributed import destroy_distributed, init_distributed

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")


@contextlib.contextmanager
def count_collectives():
    """Counts torch.distributed collective calls (by name) while active."""
    counts = collections.Counter()
    saved = {n: getattr(torch.distributed, n) for n in COLLECTIVES}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return saved[name](*args, **kwargs)
        return call

    for n in COLLECTIVES:
        setattr(torch.distributed, n, counting(n))
    try:
        yield counts
    finally:
        for n, fn in saved.items():
            setattr(torch.distributed, n, fn)


def _variants():
    from megaflow.parallel.perf_patches import PERF_PATCHES
    from megaflow.trainer.runner import FastPaths

    off = dict(single_rank_grads=False, single_rank_finalize=False, joint_adam_groups=False,
               megatron_patches=frozenset())
    out = {"plain": FastPaths(**off), "all": FastPaths()}
    for flag in ("single_rank_grads", "single_rank_finalize", "joint_adam_groups"):
        out[flag] = FastPaths(**{**off, flag: True})
    for patch in PERF_PATCHES:
        out[patch] = FastPaths(**{**off, "megatron_patches": frozenset({patch})})
    return out


def _run_steps(eng, fast_paths, mbs) -> dict:
    """Two train steps with exactly ``fast_paths.megatron_patches`` applied process-wide."""
    from megaflow.parallel.perf_patches import PERF_PATCHES, apply_perf_patches, remove_perf_patches

    remove_perf_patches()
    apply_perf_patches(skip=set(PERF_PATCHES) - set(fast_paths.megatron_patches))
    first = eng.train_step(mbs)
    grads = {k: v.clone() for k, v in eng.iter_full_grads()}
    second = eng.train_step(mbs)
    params = {k: v.clone() for k, v in eng.iter_full_params()}
    return {"losses": [float(first["loss"]), float(second["loss"])],
            "norms": [first["grad_norm"], second["grad_norm"]], "grads": grads, "params": params}


def _same(a: dict, b: dict) -> bool:
    return (a["losses"] == b["losses"] and a["norms"] == b["norms"]
            and all(torch.equal(a[k][n], b[k][n]) for k in ("grads", "params") for n in a[k]))


def _single_rank_still_needed(engines: dict, mbs) -> dict:
    """What megatron does at world size 1 that the single-rank fast paths skip."""
    from megatron.core.distributed import finalize_model_grads

    from megaflow.parallel.perf_patches import apply_perf_patches, remove_perf_patches
    from megaflow.trainer.runner import rectified_flow_loss

    plain, fast = engines["plain"], engines["all"]
    remove_perf_patches()
    plain.optimizer.zero_grad()
    plain.forward_backward(mbs, rectified_flow_loss)
    ddp = plain.model[0]
    grads_dropped = all(p.grad is None for p in ddp.params_with_grad)
    with count_collectives() as finalize_calls:
        finalize_model_grads(plain.model)
    with count_collectives() as plain_step_calls:
        plain.train_step(mbs)
    apply_perf_patches()
    fast.optimizer.zero_grad()
    fast.forward_backward(mbs, rectified_flow_loss)
    fddp = fast.model[0]
    main_grad_is_grad = all(p.main_grad is p.grad for p in fddp.params_with_grad)
    with count_collectives() as fast_step_calls:
        fast.train_step(mbs)
    inner = plain.optimizer.chained_optimizers[0].optimizer
    adam_keys = [{k: g[k] for k in inner.defaults} for g in inner.param_groups]
    return {
        # megatron: a hook per parameter copies each fresh grad into the buffer and drops it
        "megatron_hooks": len(ddp.grad_accs), "params": len(ddp.params_with_grad),
        "megatron_grads_dropped": grads_dropped,
        "fast_hooks": len(fddp.grad_accs),
        "fast_main_grad_is_grad": main_grad_is_grad,
        "finalize_collectives": sum(finalize_calls.values()),
        "fast_finalize_func": fast.config.finalize_model_grads_func,
        "plain_step_collectives": sum(plain_step_calls.values()),
        "fast_step_collectives": sum(fast_step_calls.values()),
        "adam_groups": len(adam_keys), "adam_groups_equal": all(k == adam_keys[0] for k in adam_keys),
    }


def _unused_param_case() -> dict:
    """SingleRankDDP vs megatron's DDP on a module with a parameter that gets no grad: two
    accumulated backwards, then a write into the handed-out buffer view, then a re-zero."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    from megaflow.trainer.runner import SingleRankDDP

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.linear = torch.nn.Linear(4, 4)
            self.unused = torch.nn.Parameter(torch.randn(3))

        def forward(self, x):
            return self.linear(x)

    cfg = TransformerConfig(num_layers=1, hidden_size=4, num_attention_heads=1)
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    out = {}
    for name, cls in (("megatron", DistributedDataParallel), ("single", SingleRankDDP)):
        ddp = cls(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), Module())
        ddp.zero_grad_buffer()
        for scale in (1.0, 3.0):
            (scale * ddp(x).square().sum()).backward()
        grads = {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}
        ddp.module.unused.main_grad.add_(7.0)  # e.g. an optimizer scaling what it was handed
        ddp.zero_grad_buffer()
        out[name] = {"grads": grads, "rezeroed": all(float(p.main_grad.abs().max()) == 0
                                                     for p in ddp.module.parameters())}
    m, s = out["megatron"], out["single"]
    return {"equal": all(torch.equal(m["grads"][n], s["grads"][n]) for n in m["grads"]),
            "unused_zero": float(s["grads"]["unused"].abs().max()) == 0.0,
            "rezeroed": m["rezeroed"] and s["rezeroed"]}


def fast_paths_rank(dcfg: dict) -> dict:
    """Every fast-path variant vs megatron's own path (bitwise), and the still-needed checks."""
    from megaflow.models.sd3 import from_diffusers, tiny
    from megaflow.trainer.runner import Trainer, adam_config, load_checked, rectified_flow_microbatch

    init_distributed(ParallelDims(), seed=3)
    mbs = [rectified_flow_microbatch(b["x0"], b["noise"], b["sigma"], b["encoder_hidden_states"],
                                     b["pooled_projections"])
           for b in tiny.sft_batches(dcfg, num_microbatches=2, batch=2, context_len=6, seed=4)]
    variants = _variants()
    engines, state = {}, None
    for name, fp in variants.items():
        eng = Trainer(from_diffusers(dcfg), spec="local", fast_paths=fp,
                      optimizer_config=adam_config(lr=1e-3, grad_clip=0.05, distributed=False))
        state = state or {k: v.clone() for k, v in eng.chunks[0].state_dict().items() if torch.is_tensor(v)}
        load_checked(eng.chunks[0], state)
        engines[name] = eng
    results = {name: _run_steps(engines[name], variants[name], mbs) for name in variants}
    report = {
        "active": {name: eng.fast_paths_active for name, eng in engines.items()},
        "differs": sorted(n for n in variants if not _same(results[n], results["plain"])),
        "clipped": results["plain"]["norms"][0] > 0.05,
        "needed": _single_rank_still_needed(engines, mbs),
        "unused_param": _unused_param_case(),
    }
    destroy_distributed()
    return report
