"""Trainer's fast paths: the same work done cheaper, with bit-identical grads and updates
(tests/trainer/test_fast_paths.py).

The ``single_rank_*`` ones apply only when this process is the whole job (world size 1), where
megatron's data-parallel machinery has nothing to communicate but still runs; multi-process layouts
use megatron's code unchanged. ``joint_adam_groups`` and the foreach switch apply to any layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from megaflow.parallel.perf_patches import PERF_PATCHES


@dataclass(frozen=True, kw_only=True)
class FastPaths:
    """Which shortcuts Trainer takes (each individually switchable; all on by default)."""

    single_rank_grads: bool = True
    """Grads stay where autograd accumulates them (``SingleRankDDP``): no per-parameter Python hook
    copying each fresh ``param.grad`` into DDP's contiguous buffer, which exists to be reduced."""
    single_rank_finalize: bool = True
    """No ``finalize_model_grads``: with one process every collective in it is over a size-1 group
    (identity). Only where it has no other work (see ``_finalize_is_identity``)."""
    joint_adam_groups: bool = True
    """torch Adam(W) steps megatron's param groups with equal hyperparameters in one call
    (``_JointGroupStep``); any layout."""
    megatron_patches: frozenset[str] = frozenset(PERF_PATCHES)
    """Which of ``megaflow.parallel.perf_patches.PERF_PATCHES`` to apply (process-wide, idempotent; leaving
    one out does not remove it if something else applied it)."""


def select_fast_paths(fast: FastPaths, config, ddp_config: DistributedDataParallelConfig, *,
                      has_optimizer: bool) -> dict[str, bool]:
    """Which of ``fast``'s engine-level shortcuts apply to this job and layout: {name: on}."""
    single = _single_process()
    return {"single_rank_grads": fast.single_rank_grads and single and _grads_can_bypass_buffer(config, ddp_config),
            "single_rank_finalize": fast.single_rank_finalize and single and _finalize_is_identity(config, ddp_config),
            "joint_adam_groups": fast.joint_adam_groups and has_optimizer}


def _single_process() -> bool:
    return torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1


def _finalize_is_identity(config, ddp_config: DistributedDataParallelConfig) -> bool:
    """Whether ``finalize_model_grads`` does nothing but size-1 collectives in a one-process job:
    no per-token loss scaling, no MoE router updates, no async grad/param sync to wait for, no
    separate fp32 main_grads to copy back."""
    return (not config.calculate_per_token_loss and config.num_moe_experts is None
            and not getattr(config, "flextron", False) and not ddp_config.overlap_grad_reduce
            and not ddp_config.overlap_param_gather
            and not ddp_config.param_name_patterns_for_fp32_local_accumulation)


def _grads_can_bypass_buffer(config, ddp_config: DistributedDataParallelConfig) -> bool:
    """Whether nothing in a one-process step reads or writes DDP's grad buffer except through
    ``param.main_grad``: no reduction during backward, no distributed optimizer (it reads buffer
    shards), no buffer-wide NaN check or per-token scaling, no fused or delayed wgrad writing into
    main_grad, no CUDA-graph replay."""
    return (_finalize_is_identity(config, ddp_config) and not ddp_config.use_distributed_optimizer
            and not ddp_config.check_for_nan_in_grad and not ddp_config.check_for_large_grads
            and not ddp_config.delay_wgrad_compute and not config.gradient_accumulation_fusion
            and getattr(config, "cuda_graph_impl", "none") == "none")


class SingleRankDDP(DistributedDataParallel):
    """megatron's DDP for a one-process job: grads stay where autograd accumulates them.

    DDP's contiguous grad buffer exists to be all-reduced / reduce-scattered. megatron fills it with
    a Python hook per parameter, run by autograd after each grad accumulation, that adds the fresh
    ``param.grad`` into ``param.main_grad`` (a view of the buffer) and drops it. With one process
    there is nothing to reduce, so here those hooks are gone and, once per backward (a callback
    queued by a hook on the model output), ``param.main_grad`` is bound to ``param.grad``, which
    autograd keeps accumulating into over microbatches. Same numbers (megatron's 0 + g1 + g2 ...
    vs g1 + g2 ...: adding to an exact zero is exact); no copy, no hook calls, no second grad.
    ``zero_grad_buffer`` drops the grads and re-binds ``main_grad`` to the buffer views, which a
    parameter that gets no grad keeps. Nothing writes those views any more, so instead of zeroing
    the whole buffer (megatron) it zeroes only views that were still bound as ``main_grad``, i.e.
    handed out beyond the backward window (to the optimizer, which may scale them in place).

    Covers parameters whose grad buffer has their dtype (fp32 params, fp32 grads); with any other,
    that one keeps megatron's hook and the buffer is zeroed as usual. Backward must pass through
    this module's output (any loss of it does); as with megatron's DDP, ``main_grad`` is the grad
    only after backward (writing into it before backward is not supported). Use only where
    ``_grads_can_bypass_buffer`` holds (Trainer checks)."""

    def __init__(self, config, ddp_config, module, **kwargs):
        if ddp_config.overlap_grad_reduce or ddp_config.use_distributed_optimizer:
            raise ValueError("SingleRankDDP needs overlap_grad_reduce=False and no distributed optimizer")
        super().__init__(config, ddp_config, module, **kwargs)
        self.buffer_views = {p: p.main_grad for p in self.params_with_grad if p.main_grad.dtype == p.dtype}
        self.covers_all = len(self.buffer_views) == len(self.params_with_grad)
        # megatron's hooks hang on the AccumulateGrad nodes it keeps alive in grad_accs; a parameter
        # holds its node only weakly, so dropping these references drops the hooks with the nodes.
        self.grad_accs = [acc for acc in self.grad_accs if acc.variable not in self.buffer_views]

    def forward(self, *inputs, **kwargs):
        out = super().forward(*inputs, **kwargs)
        if torch.is_grad_enabled():
            first = next((t for t in (out if isinstance(out, (tuple, list)) else (out,))
                          if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if first is not None:
                first.register_hook(self._queue_bind_main_grads)
        return out

    def _queue_bind_main_grads(self, grad):
        torch.autograd.Variable._execution_engine.queue_callback(self.bind_main_grads)

    def bind_main_grads(self) -> None:
        """``main_grad = grad`` for every covered parameter that has a grad (runs after backward)."""
        for p in self.buffer_views:
            if p.grad is not None:
                p.main_grad = p.grad

    def zero_grad_buffer(self):
        if self.covers_all:  # megatron's zero_grad_buffer minus zeroing the (unwritten) buffer
            handed_out = [view for p, view in self.buffer_views.items() if p.main_grad is view]
            if handed_out:
                torch._foreach_zero_(handed_out)
            for p in self.params_with_grad:
                p.grad_added_to_main_grad = False
            for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:
                bucket_group.reset()
        else:
            super().zero_grad_buffer()
        for p, view in self.buffer_views.items():
            p.grad = None
            p.main_grad = view


def use_foreach_torch_adam(optimizer, *, joint_groups: bool) -> None:
    """Without apex/TE megatron falls back to ``torch.optim.AdamW`` with default arguments, which
    on CPU tensors means the per-tensor loop; switch its groups to the multi-tensor (foreach)
    implementation (same math; measured ~1.4x faster step on the tiny CPU model). With
    ``joint_groups``, also step equal-hyperparameter groups together (``_JointGroupStep``)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for group in inner.param_groups:
                if group.get("foreach") is None and not group.get("fused"):
                    group["foreach"] = True
            if joint_groups and not isinstance(inner.step, _JointGroupStep):
                inner.step = _JointGroupStep(inner)


class _JointGroupStep:
    """A torch Adam(W)'s ``step`` that runs param groups whose Adam hyperparameters are all equal
    as one group: megatron splits params into weight-decay / no-weight-decay groups (plus lr_mult
    and expert groups), which with equal settings (e.g. weight_decay=0) only doubles the foreach
    kernel launches and Python set-up (measured +7% of the Adam step on the bench model). Adam is
    elementwise per tensor, so the update is bit-identical; state stays keyed by parameter and the
    groups are restored after the step (checkpoints and LR schedules see megatron's groups)."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner, self.step, self.keys = inner, inner.step, tuple(inner.defaults)

    def __call__(self, closure=None):
        groups = self.inner.param_groups
        joint: dict[tuple, list[dict]] = {}
        try:
            for g in groups:
                joint.setdefault(tuple(g[k] for k in self.keys), []).append(g)
        except TypeError:  # an unhashable hyperparameter value: step group by group
            return self.step(closure)
        if len(joint) == len(groups):
            return self.step(closure)
        self.inner.param_groups = [{**gs[0], "params": [p for g in gs for p in g["params"]]} for gs in joint.values()]
        try:
            return self.step(closure)
        finally:
            self.inner.param_groups = groups
