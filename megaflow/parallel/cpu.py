"""The ONLY place that adapts megatron-core (pinned 0.19.2) to CPU + gloo: named, idempotent shims, each
switchable (``apply_cpu_shims(skip=...)``) and undoable. Invariant: tests/parallel/test_cpu_shims.py turns each
off and checks its failure returns. Design notes: docs/design/parallel.md.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from megaflow.parallel.patching import (
    MCORE_VERSION, apply_table, check_known, installed_mcore_version, remove_applied, set_attrs, torch_view_patch,
)


def _cpu_device():
    return torch.device("cpu")


def _no_op(*args, **kwargs):
    return None


def _cpu_if_cuda(device):
    """Map a CUDA device spec ('cuda', 'cuda:0', torch.device('cuda'), int index) to the CPU."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


def _factory_on_cpu(fn):
    """Wrap a tensor factory (torch.zeros, ...) so that ``device="cuda"`` allocates on the CPU."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        return fn(*args, **kwargs)

    return wrapper


class _NullStream:
    """A CUDA-stream stand-in whose synchronisation calls do nothing (CPU ops are synchronous)."""

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass


def _null_stream(*args, **kwargs) -> _NullStream:
    return _NullStream()


_CUDA_LITERAL_FACTORIES = {
    name: _factory_on_cpu(getattr(torch, name))
    for name in ("tensor", "zeros", "empty", "ones", "full", "empty_like")
}


@contextlib.contextmanager
def _cuda_type_names():
    """While active, ``cpu_tensor.type()`` answers 'torch.cuda.FloatTensor' etc."""
    had_own = "type" in torch.Tensor.__dict__
    original = torch.Tensor.type

    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs and self.device.type == "cpu":
            return original(self).replace("torch.", "torch.cuda.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_
    try:
        yield
    finally:
        if had_own:
            torch.Tensor.type = original
        else:
            del torch.Tensor.type


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    return wrapper


def _type_names_patch(targets: tuple[tuple[str, str], ...]):
    """A shim body: run each (module, 'func' or 'Class.method') under ``_cuda_type_names``.

    A module-level function is replaced in every loaded megatron module that imported it by name.
    """

    def apply() -> Callable[[], None]:
        patches = []
        for module_name, qualname in targets:
            module = importlib.import_module(module_name)
            if "." in qualname:
                cls_name, meth = qualname.split(".")
                cls = getattr(module, cls_name)
                patches.append((cls, meth, _with_cuda_type_names(cls.__dict__[meth])))
                continue
            fn = getattr(module, qualname)
            wrapped = _with_cuda_type_names(fn)
            for mod in list(sys.modules.values()):
                in_mcore = getattr(mod, "__name__", "").startswith("megatron.core")
                if in_mcore and mod.__dict__.get(qualname) is fn:
                    patches.append((mod, qualname, wrapped))
        return set_attrs(patches)

    return apply


def _rng_tracker_patch() -> Callable[[], None]:
    """Route megatron's model-parallel RNG tracker to the CPU default generator."""
    from megatron.core.tensor_parallel import random as mrandom

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def add(self, name, seed):
        """CPU twin of CudaRNGStatesTracker.add: seed a named state, leave the current one as is."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        orig = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(orig)

    # fork() compares the CPU RNG state before/after to warn about "CPU RNG used inside a GPU RNG
    # context"; with the tracker on the CPU generator that is every fork that draws numbers.
    log_filter = _DropMessage("CPU RNG state changed within GPU RNG context")
    logger = logging.getLogger(mrandom.__name__)
    logger.addFilter(log_filter)
    undo_attrs = set_attrs(
        [
            (mrandom, "_get_cuda_rng_state", get_state),
            (mrandom, "_set_cuda_rng_state", set_state),
            (mrandom.CudaRNGStatesTracker, "add", add),
        ]
    )

    def undo():
        undo_attrs()
        logger.removeFilter(log_filter)

    return undo


class _DropMessage(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record):
        return self.text not in record.getMessage()


# ---------------------------------------------------------------------------------------------
# The shim table.


@dataclass(frozen=True)
class CpuShim:
    """One named CPU adaptation: what it patches and which failure it prevents."""

    name: str
    patches: str
    prevents: str
    apply: Callable[[], Callable[[], None]] = field(repr=False)


_TP = ("megatron.core.tensor_parallel.layers", "megatron.core.tensor_parallel.mappings",
       "megatron.core.tensor_parallel.utils", "megatron.core.utils")

SHIMS: dict[str, CpuShim] = {
    s.name: s
    for s in [
        CpuShim(
            name="rng_tracker",
            patches="tensor_parallel.random: _get/_set_cuda_rng_state, CudaRNGStatesTracker.add "
            "-> CPU default generator",
            prevents="model_parallel_cuda_manual_seed / tracker.fork() raising 'Found no NVIDIA driver'",
            apply=_rng_tracker_patch,
        ),
        CpuShim(
            name="allocation_device",
            patches="torch.cuda.current_device() -> cpu in " + ", ".join(_TP),
            prevents="TP layers, SP/TP mappings and the global memory buffer allocating on CUDA",
            apply=torch_view_patch(_TP, cuda_attrs={"current_device": _cpu_device}),
        ),
        CpuShim(
            name="pipeline_device",
            patches="pipeline_parallel.schedules: device='cuda' literals; p2p_communication: "
            "current_device() -> cpu, synchronize() -> no-op",
            prevents="forward_backward_func (any schedule) and PP send/recv failing on CUDA tensors",
            apply=torch_view_patch(
                ("megatron.core.pipeline_parallel.schedules",
                 "megatron.core.pipeline_parallel.p2p_communication"),
                torch_attrs=_CUDA_LITERAL_FACTORIES,
                cuda_attrs={"current_device": _cpu_device, "synchronize": _no_op},
            ),
        ),
        CpuShim(
            name="ddp_grad_buffer",
            patches="distributed.param_and_grad_buffer: torch.cuda.current_stream() -> no-op stream, "
            "current_device() -> cpu",
            prevents="DDP grad/param buffers allocated on CUDA; grad sync calling "
            "torch.cuda.current_stream()",
            apply=torch_view_patch(
                ("megatron.core.distributed.param_and_grad_buffer",),
                cuda_attrs={"current_stream": _null_stream, "current_device": _cpu_device},
            ),
        ),
        CpuShim(
            name="optimizer_device",
            patches="optimizer.optimizer / distrib_optimizer / clip_grads / core.utils: device='cuda' "
            "literals and current_device() -> cpu",
            prevents="optimizer step, grad-norm and grad-clip allocating CUDA tensors",
            apply=torch_view_patch(
                ("megatron.core.optimizer.optimizer", "megatron.core.optimizer.distrib_optimizer",
                 "megatron.core.optimizer.clip_grads", "megatron.core.utils"),
                torch_attrs=_CUDA_LITERAL_FACTORIES,
                cuda_attrs={"current_device": _cpu_device},
            ),
        ),
        CpuShim(
            name="clip_grads_type",
            patches="optimizer.clip_grads.clip_grad_by_total_norm_fp32 runs with CUDA tensor type names",
            prevents="AssertionError: param.grad.type() == 'torch.cuda.FloatTensor' when clipping",
            apply=_type_names_patch(
                (("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32"),)
            ),
        ),
        CpuShim(
            name="optimizer_type_names",
            patches="DistributedOptimizer.__init__ and Float16OptimizerWithFloat16Params.__init__ run "
            "with CUDA tensor type names",
            prevents="TypeError 'Wrapped parameters must be one of torch.cuda.FloatTensor, ...'",
            apply=_type_names_patch(
                (
                    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__"),
                    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__"),
                )
            ),
        ),
        CpuShim(
            name="dist_ckpt_device",
            patches="dist_checkpointing.strategies.{state_dict_saver, filesystem_async, fully_parallel} "
            "and dist_checkpointing.exchange_utils: device='cuda' literals, current_device() -> cpu, "
            "synchronize() -> no-op",
            prevents="dist_checkpointing.save (tensor preload, failure flag broadcast) touching CUDA",
            apply=torch_view_patch(
                ("megatron.core.dist_checkpointing.strategies.state_dict_saver",
                 "megatron.core.dist_checkpointing.strategies.filesystem_async",
                 "megatron.core.dist_checkpointing.strategies.fully_parallel",
                 "megatron.core.dist_checkpointing.exchange_utils"),
                torch_attrs=_CUDA_LITERAL_FACTORIES,
                cuda_attrs={"current_device": _cpu_device, "synchronize": _no_op},
            ),
        ),
    ]
}

_APPLIED: dict[str, Callable[[], None]] = {}


def check_mcore_version(installed: str | None = None) -> None:
    """Raise if megatron-core is not the version these shims were verified on."""
    installed = installed or installed_mcore_version()
    if installed != MCORE_VERSION:
        raise RuntimeError(
            f"megaflow's CPU shims were verified on megatron-core=={MCORE_VERSION}, found {installed}; "
            "run tests/parallel/test_cpu_shims.py and update megaflow/parallel/cpu.py"
        )


def apply_cpu_shims(skip: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Apply every shim not in ``skip`` (idempotent); returns the names now applied.

    Call only on machines without CUDA (``init_distributed`` does that for you).
    """
    check_known(SHIMS, skip, "CPU shim(s)")
    check_mcore_version()
    return apply_table(SHIMS, _APPLIED, skip)


def remove_cpu_shims(names: set[str] | None = None) -> None:
    """Undo the given applied shims (default: all), restoring megatron's own code."""
    remove_applied(_APPLIED, names)


def applied_cpu_shims() -> list[str]:
    """Names of the shims currently applied."""
    return sorted(_APPLIED)
