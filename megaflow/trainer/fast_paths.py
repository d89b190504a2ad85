"""Trainer's fast paths: the same work done cheaper, with bit-identical grads and updates
(tests/trainer/test_fast_paths.py). ``single_rank_*`` apply only at world size 1; ``joint_adam_groups`` and
the foreach switch to any layout. Design notes: docs/design/trainer.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from megaflow.parallel.perf_patches import PERF_PATCHES
from megaflow.trainer.offload import inner_torch_optimizers


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
    """Whether nothing in a one-process step touches DDP's grad buffer except through ``param.main_grad``."""
    return (_finalize_is_identity(config, ddp_config) and not ddp_config.use_distributed_optimizer
            and not ddp_config.check_for_nan_in_grad and not ddp_config.check_for_large_grads
            and not ddp_config.delay_wgrad_compute and not config.gradient_accumulation_fusion
            and getattr(config, "cuda_graph_impl", "none") == "none")


class SingleRankDDP(DistributedDataParallel):
    """megatron's DDP for a one-process job: ``param.main_grad`` is bound to ``param.grad`` after each backward, no
    hooks, no buffer copy (docs/design/trainer.md). Covers parameters whose grad buffer has their dtype; backward
    must pass through this module's output. Use only where ``_grads_can_bypass_buffer`` holds (Trainer checks)."""

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
    """Switch megatron's fallback ``torch.optim.AdamW`` groups to the foreach implementation (same math); with
    ``joint_groups``, also step equal-hyperparameter groups together (``_JointGroupStep``)."""
    for inner in inner_torch_optimizers(optimizer):
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for group in inner.param_groups:
                if group.get("foreach") is None and not group.get("fused"):
                    group["foreach"] = True
            if joint_groups and not isinstance(inner.step, _JointGroupStep):
                inner.step = _JointGroupStep(inner)


class _JointGroupStep:
    """An Adam(W) ``step`` running param groups with equal hyperparameters as one (bit-identical); megatron's
    groups are restored after the step."""

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
