"""SGLang diffusion plugin (group ``sglang.multimodal_gen.plugins``): in each engine worker, freeze the heap
once the scheduler is built, keep staging slots mapped, hash tensors for verification without copying them, run no
text encoder code the server args do not trust, run the CPU layers ``sgl_kernel`` lacks as torch (``cpu_ops``).
Design notes: docs/design/rollout.md.
"""
from __future__ import annotations

import gc
import os

from megaflow.config.remote_code import refuse_remote_code
from megaflow.rollout.sglang import cpu_ops, weight_checks

ENV_VAR = "MEGAFLOW_SGLANG_GC_FREEZE"
HOOK_TARGET = "sglang.multimodal_gen.runtime.managers.scheduler.Scheduler.__init__"
PAYLOAD_TARGET = ("sglang.multimodal_gen.runtime.post_training.weights_updater.WeightsUpdater."
                  "_materialize_weights_iter")
ENDPOINT_TARGET = "sglang.multimodal_gen.runtime.server_args.server_args.ServerArgs.scheduler_endpoint_for"
RENDEZVOUS_TARGET = "sglang.multimodal_gen.runtime.distributed.parallel_state.init_distributed_environment"
ENCODER_CONFIG_TARGET = ("sglang.multimodal_gen.runtime.loader.component_loaders.text_encoder_loader.TextEncoderLoader."
                         "build_model_config")
SOCKET_DIR_VAR = "MEGAFLOW_SGLANG_SOCKET_DIR"
LOOPBACK_TCP = "tcp://127.0.0.1:"
KEEP_KEY = "megaflow_keep_mapping"  # the payload key (weights.KEEP_KEY)

_kept: dict[str, object] = {}
"""Staging-slot key -> the last flattened tensor received under it (this worker's kept mappings)."""

_socket_dirs: dict[int, str] = {}
"""In the process hosting engines: scheduler port -> that engine's private directory (``own_sockets``)."""


def register() -> None:
    """SGLang's plugin callback: hook the scheduler's constructor, the weight updater's payload reader, its
    tensor hash and its updates (only when ``ENV_VAR`` is "1")."""
    if os.environ.get(ENV_VAR) != "1":
        return
    from sglang.multimodal_gen.runtime.platforms.plugins import plugin_hook
    from sglang.srt.plugins.hook_registry import HookType

    plugin_hook(HOOK_TARGET)(freeze_heap)
    plugin_hook(PAYLOAD_TARGET, HookType.AROUND)(keep_mapping)
    plugin_hook(weight_checks.HASH_TARGET, HookType.REPLACE)(weight_checks.tensor_digest)
    plugin_hook(weight_checks.UPDATE_TARGET, HookType.AROUND)(weight_checks.check_update)
    plugin_hook(weight_checks.COPY_TARGET, HookType.AROUND)(weight_checks.hash_as_copied)
    plugin_hook(weight_checks.VERIFY_TARGET, HookType.AROUND)(weight_checks.verify_engine_names)
    plugin_hook(ENDPOINT_TARGET, HookType.AROUND)(private_scheduler_endpoint)
    plugin_hook(RENDEZVOUS_TARGET, HookType.AROUND)(private_rendezvous)
    plugin_hook(ENCODER_CONFIG_TARGET, HookType.AROUND)(untrusted_encoder_config)
    plugin_hook(cpu_ops.NORM_SCALE_SHIFT_TARGET, HookType.AROUND)(cpu_ops.norm_scale_shift_cpu)
    plugin_hook(cpu_ops.RESIDUAL_NORM_SCALE_SHIFT_TARGET, HookType.AROUND)(cpu_ops.residual_norm_scale_shift_cpu)


def own_sockets(scheduler_port: int, directory: str) -> None:
    """In the hosting process: the engine whose scheduler port is ``scheduler_port`` keeps its sockets in
    ``directory`` (its workers learn it from ``SOCKET_DIR_VAR``)."""
    _socket_dirs[scheduler_port] = directory


def disown_sockets(scheduler_port: int) -> None:
    _socket_dirs.pop(scheduler_port, None)


def _socket_dir(scheduler_port: int) -> str | None:
    return _socket_dirs.get(scheduler_port) or os.environ.get(SOCKET_DIR_VAR)


def private_scheduler_endpoint(original, server_args, replica: int, *args, **kwargs) -> str:
    """Around ``ServerArgs.scheduler_endpoint_for``: a loopback TCP endpoint becomes an ipc socket in the
    engine's private directory (in the hosting process and in the workers alike)."""
    endpoint = original(server_args, replica, *args, **kwargs)
    directory = _socket_dir(server_args.scheduler_port)
    if directory is None or not endpoint.startswith(LOOPBACK_TCP):
        return endpoint
    return f"ipc://{directory}/scheduler-{replica}"


def private_rendezvous(original, *args, **kwargs):
    """Around SGLang's ``init_distributed_environment`` in a worker: a loopback TCP rendezvous (a TCP store
    that would listen on every interface) becomes a file store in the engine's private directory."""
    import inspect

    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    method, directory = bound.arguments["distributed_init_method"], os.environ.get(SOCKET_DIR_VAR)
    if directory and isinstance(method, str) and method.startswith(LOOPBACK_TCP):
        bound.arguments["distributed_init_method"] = f"file://{directory}/rendezvous"
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return original(*bound.args, **bound.kwargs)


def untrusted_encoder_config(original, loader, component_model_path, model_config, server_args, *args, **kwargs):
    """Around SGLang's ``TextEncoderLoader.build_model_config``, which asks transformers' AutoConfig with remote code
    trusted whatever the server args say: a text encoder folder whose config names code is refused in the worker
    unless the server args trust remote code."""
    refuse_remote_code(component_model_path, "text encoder", trust=bool(getattr(server_args, "trust_remote_code",
                                                                                 False)))
    return original(loader, component_model_path, model_config, server_args, *args, **kwargs)


def freeze_heap(result, *args, **kwargs) -> None:
    """After ``Scheduler.__init__``: collect once, then freeze every surviving object."""
    gc.collect()
    gc.freeze()


def keep_mapping(original, updater, module_payload, *args, **kwargs):
    """Around ``WeightsUpdater._materialize_weights_iter``: a staging slot's payload (``KEEP_KEY``) either brings
    the slot's flattened tensor, kept under the key (and so its mapping), or names the key alone and gets the
    tensor kept there; payloads without a key are left alone."""
    if isinstance(module_payload, dict) and module_payload.get(KEEP_KEY):
        key = str(module_payload[KEEP_KEY])
        if module_payload.get("flattened_tensor") is not None:
            _kept[key] = module_payload["flattened_tensor"]
        elif key in _kept:
            module_payload["flattened_tensor"] = _kept[key]
        else:
            raise ValueError(f"staging slot {key} is not mapped in this worker")
    return original(updater, module_payload, *args, **kwargs)
