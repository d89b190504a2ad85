"""The ONLY place that adapts megatron-core (pinned 0.19.2) to CPU + gloo.

megatron-core assumes a CUDA device in a handful of places. On a machine without one we apply the
shims below, each a named, documented, idempotent patch that can be switched off on its own
(``apply_cpu_shims(skip={...})``) and undone (``remove_cpu_shims()``). tests/parallel/test_cpu_shims.py
switches each one off and checks that its named failure comes back, so a megatron upgrade that
makes a shim unnecessary or insufficient fails the test suite instead of going unnoticed.

How the patches stay confined:
- Most CUDA assumptions are calls like ``torch.cuda.current_device()`` or literal ``device="cuda"``
  inside a few megatron modules. For those modules only, the module-global name ``torch`` is
  replaced by a ``_TorchView``: it forwards every attribute to the real torch except the few
  entries a shim overrides (e.g. ``torch.cuda.current_device`` -> cpu, ``torch.zeros(...,
  device="cuda")`` -> cpu). Nothing outside the listed modules sees any change; torch itself is
  never modified.
- The RNG tracker shim replaces two helpers and one method in ``megatron.core.tensor_parallel.random``.
- The tensor-type-name shims wrap specific megatron functions so that, only while they run,
  ``Tensor.type()`` of a CPU tensor reports the CUDA type name they check for.

Not needed any more (checked on 0.19.2 in the project venv): ``transformer/moe/ops/paged_stash.py``
imports triton unconditionally, but sglang's install brings triton, so ``import megatron.core``
works without a shim.

SP with torch norms is not a patch: megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel``.
Use ``SPTorchNorm`` (below) as the layer-norm builder in layer specs instead.

A separate section, "Performance patches" (``PERF_PATCHES``, ``apply_perf_patches``), holds patches
that no correctness depends on: bit-identical replacements for megatron's no-apex fallbacks and for
its size-1-group identities, applied by ``TrainEngine`` and switchable one by one.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import logging
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

MCORE_VERSION = "0.19.2"
"""The megatron-core version these shims were written and tested against."""


# ---------------------------------------------------------------------------------------------
# Mechanism 1: a per-module view of `torch` with a few CUDA entry points routed to the CPU.


class _CudaView:
    """Stands in for ``torch.cuda`` inside one megatron module; overrides win, rest forwards."""

    def __init__(self, torch_view: "_TorchView"):
        self._torch_view = torch_view

    def __getattr__(self, name):
        return self.__dict__["_torch_view"]._resolve(self, "cuda", name, torch.cuda)


class _TorchView:
    """Stands in for ``torch`` inside one megatron module; overrides win, rest forwards.

    Overrides come in layers, one per applied shim, so removing one shim never removes another's
    override of the same name. A name, once resolved, is cached in the view's ``__dict__`` (a plain
    attribute hit afterwards: megatron looks up e.g. ``torch.no_grad`` ~100 times per training
    step); the cache is dropped whenever a layer is added or removed. So a torch attribute rebound
    after a module first used it is not seen by that module until the next layer change.
    """

    def __init__(self):
        self._layers: dict[object, dict[str, dict]] = {}  # shim token -> {"torch"|"cuda": overrides}
        self._cached: list[tuple[object, str]] = []
        self.cuda = _CudaView(self)

    def _lookup(self, namespace: str, name: str, fallback):
        for layer in self.__dict__["_layers"].values():
            if name in layer[namespace]:
                return layer[namespace][name]
        return getattr(fallback, name)

    def _resolve(self, holder, namespace: str, name: str, fallback):
        value = self._lookup(namespace, name, fallback)
        holder.__dict__[name] = value
        self.__dict__["_cached"].append((holder, name))
        return value

    def __getattr__(self, name):
        return self._resolve(self, "torch", name, torch)

    def set_layer(self, token, layer: dict | None) -> None:
        """Add (``layer``) or remove (``None``) the overrides of one shim; drops the name cache."""
        if layer is None:
            del self._layers[token]
        else:
            self._layers[token] = layer
        for holder, name in self._cached:
            holder.__dict__.pop(name, None)
        self._cached.clear()


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
_VIEWS: dict[str, _TorchView] = {}


def _torch_view_patch(modules: tuple[str, ...], *, torch_attrs=None, cuda_attrs=None):
    """A shim body: give each module a torch view with these overrides; returns its undo.

    The view is installed as the module's global ``torch`` while any shim has a layer in it and
    removed (the real torch put back) when the last layer goes.
    """
    layer = {"torch": dict(torch_attrs or {}), "cuda": dict(cuda_attrs or {})}

    def apply() -> Callable[[], None]:
        token = object()
        for name in modules:
            module = importlib.import_module(name)
            if name not in _VIEWS:
                assert module.torch is torch, f"{name}.torch is not torch"
                _VIEWS[name] = module.torch = _TorchView()
            _VIEWS[name].set_layer(token, layer)

        def undo():
            for name in modules:
                view = _VIEWS[name]
                view.set_layer(token, None)
                if not view._layers:
                    sys.modules[name].torch = torch
                    del _VIEWS[name]

        return undo

    return apply


# ---------------------------------------------------------------------------------------------
# Mechanism 2: direct attribute patches (RNG tracker) and CUDA type names during given calls.


def _set_attrs(patches: list[tuple[object, str, object]]) -> Callable[[], None]:
    """Set each (owner, name, value); return an undo restoring the originals (or deleting)."""
    saved = [(owner, name, owner.__dict__.get(name, _MISSING)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)

    def undo():
        for owner, name, old in reversed(saved):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)

    return undo


_MISSING = object()


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
        return _set_attrs(patches)

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
    undo_attrs = _set_attrs(
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
            apply=_torch_view_patch(_TP, cuda_attrs={"current_device": _cpu_device}),
        ),
        CpuShim(
            name="pipeline_device",
            patches="pipeline_parallel.schedules: device='cuda' literals; p2p_communication: "
            "current_device() -> cpu, synchronize() -> no-op",
            prevents="forward_backward_func (any schedule) and PP send/recv failing on CUDA tensors",
            apply=_torch_view_patch(
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
            apply=_torch_view_patch(
                ("megatron.core.distributed.param_and_grad_buffer",),
                cuda_attrs={"current_stream": _null_stream, "current_device": _cpu_device},
            ),
        ),
        CpuShim(
            name="optimizer_device",
            patches="optimizer.optimizer / distrib_optimizer / clip_grads / core.utils: device='cuda' "
            "literals and current_device() -> cpu",
            prevents="optimizer step, grad-norm and grad-clip allocating CUDA tensors",
            apply=_torch_view_patch(
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
            apply=_torch_view_patch(
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


def installed_mcore_version() -> str:
    """megatron-core's installed distribution version (package_info.__version__ may carry a +git tag)."""
    return importlib.metadata.version("megatron-core")


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
    unknown = set(skip) - SHIMS.keys()
    if unknown:
        raise ValueError(f"unknown CPU shim(s) {sorted(unknown)}; known: {sorted(SHIMS)}")
    check_mcore_version()
    for name, shim in SHIMS.items():
        if name not in skip and name not in _APPLIED:
            _APPLIED[name] = shim.apply()
    return sorted(_APPLIED)


def remove_cpu_shims(names: set[str] | None = None) -> None:
    """Undo the given applied shims (default: all), restoring megatron's own code."""
    for name in reversed(list(_APPLIED)):
        if names is None or name in names:
            _APPLIED.pop(name)()


def applied_cpu_shims() -> list[str]:
    """Names of the shims currently applied."""
    return sorted(_APPLIED)


# ---------------------------------------------------------------------------------------------
# Performance patches (separate from the correctness shims above).
#
# Not needed for anything to work: each replaces a slow megatron code path with one that computes
# bit-identical results, and each only touches a path that is a fallback (no apex / Transformer
# Engine) or an identity (a size-1 process group), so layouts that really communicate are
# unchanged. Applied by ``TrainEngine`` on any device (``apply_perf_patches(skip={...})``),
# individually switchable and removable. tests/parallel/test_perf_patches.py checks, per patch,
# that the slow path it replaces is still megatron's (still needed) and that grads / norms /
# updates are bit-identical with and without it.


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
    return _set_attrs(patches)


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
    return _set_attrs([(layers, n, _identity_at_tp1(getattr(layers, n))) for n in names])


def _dtensor_passthrough_patch() -> Callable[[], None]:
    from megatron.core import utils as mutils

    original = mutils.to_local_if_dtensor
    dtensor = mutils.DTensor if mutils.HAVE_DTENSOR else ()

    @functools.wraps(original)
    def to_local_if_dtensor(tensor):
        return original(tensor) if isinstance(tensor, dtensor) else tensor

    return _set_attrs([(mod, "to_local_if_dtensor", to_local_if_dtensor) for mod in list(sys.modules.values())
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
            apply=_torch_view_patch(("megatron.core.optimizer.clip_grads",),
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
    unknown = set(skip) - PERF_PATCHES.keys()
    if unknown:
        raise ValueError(f"unknown perf patch(es) {sorted(unknown)}; known: {sorted(PERF_PATCHES)}")
    if installed_mcore_version() != MCORE_VERSION:
        warnings.warn(f"megaflow perf patches skipped: verified on megatron-core=={MCORE_VERSION}, "
                      f"found {installed_mcore_version()}")
        return sorted(_PERF_APPLIED)
    for name, patch in PERF_PATCHES.items():
        if name not in skip and name not in _PERF_APPLIED:
            _PERF_APPLIED[name] = patch.apply()
    return sorted(_PERF_APPLIED)


def remove_perf_patches(names: set[str] | None = None) -> None:
    """Undo the given applied performance patches (default: all)."""
    for name in reversed(list(_PERF_APPLIED)):
        if names is None or name in names:
            _PERF_APPLIED.pop(name)()


def applied_perf_patches() -> list[str]:
    """Names of the performance patches currently applied."""
    return sorted(_PERF_APPLIED)


# ---------------------------------------------------------------------------------------------
# SP-capable torch norm (a layer-spec builder, not a patch).


class SPTorchNorm:
    """Torch LayerNorm/RMSNorm usable with sequence parallelism (megatron's WrappedTorchNorm refuses SP).

    With ``config.sequence_parallel`` each rank normalises its own sequence slice with replicated
    weights, so their grads are partial sums: the params are tagged ``sequence_parallel=True`` and
    ``finalize_model_grads`` all-reduces them over the TP group. A class (constructing it returns
    the torch norm) because megatron's ``build_module`` returns plain functions uncalled. Use it
    wherever a spec takes a norm: input_layernorm, pre_mlp_layernorm, TransformerBlock's layer_norm.
    Extra spec kwargs (persist_layer_norm, ...) are accepted and ignored.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused) -> torch.nn.Module:
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(
                f"SPTorchNorm supports LayerNorm/RMSNorm, got normalization={config.normalization!r}"
            )
        norm = kinds[config.normalization](hidden_size, eps=eps)
        if config.sequence_parallel:
            for param in norm.parameters():
                param.sequence_parallel = True
        return norm
