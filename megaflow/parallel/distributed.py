"""The process-wide distributed setup: the device, torch.distributed + megatron parallel_state from a
``ParallelDims`` (gloo and the CPU shims without CUDA). Design notes: docs/design/parallel.md.
"""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megaflow.parallel.dims import ParallelDims


def rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    """A barrier over the default group (nothing without one)."""
    if dist.is_initialized():
        dist.barrier()


def select_device(choice: str) -> torch.device:
    """Apply ``run.device`` to this process and every process it starts; returns ``current_device()``. Call it
    before anything queries CUDA. "cpu" hides every CUDA device; "cuda" raises ValueError without one."""
    if choice not in ("auto", "cpu", "cuda"):
        raise ValueError(f"run.device = {choice!r}: expected auto, cpu or cuda")
    if choice == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        if torch.cuda.is_available():  # torch counted the devices before the variable was set
            raise RuntimeError("run.device = cpu: CUDA was initialised in this process before the device was "
                               "selected; select it first (or launch with CUDA_VISIBLE_DEVICES=)")
    elif choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("run.device = cuda, but torch sees no CUDA device (use auto or cpu)")
    return current_device()


def current_device() -> torch.device:
    """The device this rank computes on: ``cuda:<LOCAL_RANK>`` when CUDA is visible, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _init_process_group(backend: str | None, timeout_s: float, trainers: int | None) -> None:
    """torch.distributed's default group over launch ranks ``0 .. trainers-1`` (None: every launched rank), on
    the launch's store (megaflow.parallel.groups.launch_store: torchrun's, or an in-memory one for a 1-process
    run without torchrun env: no port bound, nothing written to os.environ)."""
    from megaflow.parallel.groups import forget_launch, launch_store

    forget_launch()  # a store cached by an earlier world of this process is stale
    store, rank, world_size = launch_store(timeout_s)
    size = world_size if trainers is None else trainers
    if not 0 <= rank < size:
        raise ValueError(f"launch rank {rank} is not one of the {size} trainer ranks")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(current_device())
    dist.init_process_group(backend=backend, store=dist.PrefixStore("megaflow/trainers", store), rank=rank,
                            world_size=size, timeout=timedelta(seconds=timeout_s))


def init_distributed(
    dims: ParallelDims, *, backend: str | None = None, seed: int = 1234, timeout_s: float = 600.0,
    trainers: int | None = None,
) -> None:
    """Initialise torch.distributed (if needed), megatron parallel_state and its RNG tracker (seeded by ``seed``);
    again rebuilds parallel_state. ValueError if the world does not fit ``dims``. ``trainers``: megatron's world is
    launch ranks ``0 .. trainers-1`` (None = all)."""
    from megaflow.parallel import cpu

    if not torch.cuda.is_available():
        cpu.apply_cpu_shims()
    if not dist.is_initialized():
        _init_process_group(backend, timeout_s, trainers)
    dims.dp_for(dist.get_world_size())  # validate before megatron asserts

    from megatron.core import parallel_state, tensor_parallel

    if parallel_state.model_parallel_is_initialized():
        _destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp,
        context_parallel_size=dims.cp,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    """Undo ``init_distributed``: megatron parallel_state, then the torch process group."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        _destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    from megaflow.parallel.groups import forget_launch
    forget_launch()


def _destroy_model_parallel() -> None:
    """megatron's ``destroy_model_parallel`` forgets its process groups without destroying them: each rebuild of
    parallel_state in one process would leave a set of gloo groups behind, with their threads (~60 a rebuild on CPU).
    Destroy the groups it holds (each once; never the default group), then forget them."""
    from megatron.core import parallel_state

    default, seen = dist.group.WORLD, set()
    for value in list(vars(parallel_state).values()):
        for group in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(group, dist.ProcessGroup) and group is not default and id(group) not in seen:
                seen.add(id(group))
                dist.destroy_process_group(group)
    parallel_state.destroy_model_parallel()
