"""Performance patches of megatron-core: each replaces a slow fallback or identity path with bit-identical
results, individually switchable and removable. Invariant: tests/parallel/test_perf_patches.py checks each is
still needed and bit-identical.
"""
from __future__ import annotations

import functools
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from megaflow.parallel.patching import (
    MCORE_VERSION, apply_table, check_known, installed_mcore_version, remove_applied, set_attrs, torch_view_patch,
)


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for megatron's ``local_multi_tensor_l2_norm``: the same per-tensor norms and norm of
    norms, computed by ``torch._foreach_norm`` instead of a Python loop + ``torch.tensor(list)``."""
    norms = torch._foreach_norm(tensor_lists[0])
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for megatron's ``local_multi_tensor_scale`` (``dst.copy_(src * scale)`` per tensor)
    when src and dst are the same tensors, as in grad clipping: one in-place ``_foreach_mul_``."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
        return
    for s, d in zip(src, dst):
        d.copy_(s * scale)


def _foreach_grad_norm_patch() -> Callable[[], None]:
    from megatron.core import utils as mutils
    from megatron.core.optimizer import clip_grads

    patches = []
    if clip_grads.l2_norm_impl is mutils.local_multi_tensor_l2_norm:
        patches.append((clip_grads, "l2_norm_impl", _foreach_l2_norm))
    if clip_grads.multi_tensor_scale_impl is mutils.local_multi_tensor_scale:
        patches.append((clip_grads, "multi_tensor_scale_impl", _foreach_scale))
    return set_attrs(patches)


def _identity_at_tp1(mapping):
    """Wrap a TP mapping (an autograd Function whose forward and backward are identities on a
    size-1 group) so that on a size-1 group it returns its input without entering autograd."""

    @functools.wraps(mapping)
    def wrapper(input_, group=None):
        if group is not None and group.size() == 1:
            return input_
        return mapping(input_, group=group)

    return wrapper


def _tp1_mappings_patch() -> Callable[[], None]:
    from megatron.core.tensor_parallel import layers

    names = ("copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region")
    return set_attrs([(layers, n, _identity_at_tp1(getattr(layers, n))) for n in names])


def _dtensor_passthrough_patch() -> Callable[[], None]:
    from megatron.core import utils as mutils

    original = mutils.to_local_if_dtensor
    dtensor = mutils.DTensor if mutils.HAVE_DTENSOR else ()

    @functools.wraps(original)
    def to_local_if_dtensor(tensor):
        return original(tensor) if isinstance(tensor, dtensor) else tensor

    return set_attrs([(mod, "to_local_if_dtensor", to_local_if_dtensor) for mod in list(sys.modules.values())
                       if getattr(mod, "__name__", "").startswith("megatron.core")
                       and mod.__dict__.get("to_local_if_dtensor") is original])


_IDENTITY_ON_ONE_RANK = (torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.AVG,
                         torch.distributed.ReduceOp.MAX, torch.distributed.ReduceOp.MIN)


class _Size1CollectivesView:
    """Stands in for ``torch.distributed`` inside one megatron module: a synchronous all-reduce
    over a group of one rank returns at once, leaving the tensor as it is (what the collective
    would leave; with gloo it still costs a hand-off to its worker thread, up to ~1 ms on a loaded
    machine). Everything else forwards to the real ``torch.distributed``."""

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    @staticmethod
    def all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        if not async_op and op in _IDENTITY_ON_ONE_RANK and torch.distributed.get_world_size(group) == 1:
            return None
        return torch.distributed.all_reduce(tensor, op=op, group=group, async_op=async_op)


@dataclass(frozen=True)
class PerfPatch:
    """One named performance patch: what it replaces, and why that is equivalent."""

    name: str
    replaces: str
    equivalent_because: str
    apply: Callable[[], Callable[[], None]] = field(repr=False)


PERF_PATCHES: dict[str, PerfPatch] = {
    p.name: p
    for p in [
        PerfPatch(
            name="foreach_grad_norm",
            replaces="optimizer.clip_grads: the no-apex/TE fallbacks local_multi_tensor_l2_norm (a "
            "Python loop of torch.norm + torch.tensor(list)) and local_multi_tensor_scale (copy_(src * "
            "scale) per grad) -> torch._foreach_norm / torch._foreach_mul_",
            equivalent_because="same per-tensor norm kernel and the same norm of norms; x * s in place "
            "equals copy_(x * s) elementwise",
            apply=_foreach_grad_norm_patch,
        ),
        PerfPatch(
            name="dtensor_passthrough",
            replaces="megatron.core.utils.to_local_if_dtensor (called per grad, twice a step, by grad "
            "clipping) in every megatron.core module that imported it: a torch.no_grad() context "
            "entered and left to return a plain tensor unchanged",
            equivalent_because="for a non-DTensor both return the argument itself and run no op; "
            "DTensors still take megatron's function",
            apply=_dtensor_passthrough_patch,
        ),
        PerfPatch(
            name="size1_grad_norm_allreduce",
            replaces="optimizer.clip_grads: the synchronous all-reduce of the grad norm (and zero "
            "count) over the grad-stats group when that group has one rank",
            equivalent_because="an all-reduce (sum/avg/max/min) over one rank leaves the tensor unchanged",
            apply=torch_view_patch(("megatron.core.optimizer.clip_grads",),
                                    torch_attrs={"distributed": _Size1CollectivesView()}),
        ),
        PerfPatch(
            name="tp1_identity_mappings",
            replaces="tensor_parallel.layers: copy_to_/reduce_from_tensor_model_parallel_region on a "
            "size-1 TP group (a Python autograd Function per linear, run again in backward)",
            equivalent_because="on one rank both are the identity forward and backward",
            apply=_tp1_mappings_patch,
        ),
    ]
}

_PERF_APPLIED: dict[str, Callable[[], None]] = {}


def apply_perf_patches(skip: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Apply every performance patch not in ``skip`` (idempotent); returns the names now applied.

    On a megatron-core other than the verified one, applies none (with a warning): nothing
    depends on them, and they replace megatron internals that may have changed."""
    check_known(PERF_PATCHES, skip, "perf patch(es)")
    if installed_mcore_version() != MCORE_VERSION:
        warnings.warn(f"megaflow perf patches skipped: verified on megatron-core=={MCORE_VERSION}, "
                      f"found {installed_mcore_version()}")
        return sorted(_PERF_APPLIED)
    return apply_table(PERF_PATCHES, _PERF_APPLIED, skip)


def remove_perf_patches(names: set[str] | None = None) -> None:
    """Undo the given applied performance patches (default: all)."""
    remove_applied(_PERF_APPLIED, names)


def applied_perf_patches() -> list[str]:
    """Names of the performance patches currently applied."""
    return sorted(_PERF_APPLIED)
