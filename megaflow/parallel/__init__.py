"""Parallel layout and process setup: ParallelDims, init/destroy of torch.distributed + megatron
parallel_state, and the CPU/gloo adaptation of megatron-core (``megaflow.parallel.cpu``)."""
from megaflow.parallel.cpu import apply_cpu_shims, remove_cpu_shims
from megaflow.parallel.sp_norm import SPTorchNorm
from megaflow.parallel.dims import ParallelDims, current_device, destroy_distributed, init_distributed

__all__ = [
    "ParallelDims",
    "apply_cpu_shims",
    "current_device",
    "destroy_distributed",
    "init_distributed",
    "remove_cpu_shims",
    "SPTorchNorm",
]
