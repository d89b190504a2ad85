"""What SGLang engine workers are spawned with: their environment (launcher variables hidden, plugin on, GPU,
threads, checksum, sockets) and where their output goes; ``spawn_settings`` is open around every spawn and
restores this process after. Imports no sglang.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from megaflow._env import ENGINE_WORKER_VAR
from megaflow.parallel.placement import worker_visible_devices
from megaflow.rollout.sglang import plugin, weight_checks


@contextlib.contextmanager
def spawn_settings(*, log_file: Path | None, device_index: int | None, num_threads: int | None, checksum: str,
                   socket_dir: str):
    """While open, processes spawned get a worker's environment and output: see the module docstring and
    ``EngineServer.start`` for the arguments."""
    with (_without_launcher_env(), _pinned_device(device_index), _worker_threads(num_threads),
          _env_var(weight_checks.CHECKSUM_VAR, checksum), _env_var(plugin.SOCKET_DIR_VAR, socket_dir),
          _worker_output(log_file), _storage_pickling()):
        yield


def load_storage(data: bytes):
    """A tensor storage pickled while ``_storage_pickling`` was open, loaded weights-only."""
    import io

    import torch
    return torch.load(io.BytesIO(data), weights_only=True)


def _reduce_storage(storage):
    """Pickle a typed storage as torch does (``TypedStorage.__reduce__``), to be loaded by ``load_storage``."""
    import io

    import torch
    data = io.BytesIO()
    torch.save(storage, data, _use_new_zipfile_serialization=False)
    return load_storage, (data.getvalue(),)


@contextlib.contextmanager
def _storage_pickling():
    """Tensors handed to the workers (the server args: Wan's VAE config holds one) pickle with ``load_storage``, not
    with whatever replaced ``torch.storage._load_from_bytes`` in this process: megatron-core installs its own when
    imported (sglang's launch may import it), and a worker, where megatron is blocked (``megaflow._env``), could not
    unpickle that. A ``copyreg`` entry takes precedence over ``TypedStorage.__reduce__``."""
    import copyreg

    import torch.storage

    saved = copyreg.dispatch_table.get(torch.storage.TypedStorage)
    copyreg.pickle(torch.storage.TypedStorage, _reduce_storage)
    try:
        yield
    finally:
        if saved is None:
            copyreg.dispatch_table.pop(torch.storage.TypedStorage, None)
        else:
            copyreg.dispatch_table[torch.storage.TypedStorage] = saved


# Set by torchrun / torch elastic for the TRAINER's process group. Engine workers inherit the
# environment and would otherwise join (and wait forever for) that world instead of their own.
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def _without_launcher_env(quiet: bool = True):
    """Hide the launcher's distributed env vars while engine worker processes are spawned and switch on
    megaflow's SGLang plugin in them (``plugin``: a frozen heap makes SGLang's per-update ``gc.collect``
    cheap) and mark them engine workers (``megaflow._env``: they import no megatron); with ``quiet`` the
    workers also draw no per-call progress bars (tqdm's TQDM_DISABLE)."""
    saved = {k: os.environ.pop(k) for k in list(os.environ)
             if k in _LAUNCHER_ENV or k.startswith("TORCHELASTIC_")}
    added = {k: v for k, v in {plugin.ENV_VAR: "1", ENGINE_WORKER_VAR: "1",
                               **({"TQDM_DISABLE": "1"} if quiet else {})}.items()
             if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)
        os.environ.update(saved)


@contextlib.contextmanager
def _env_var(name: str, value: str | None):
    """While workers are spawned, environment variable ``name`` is ``value`` (then restored, or removed if it
    was unset); None: leave it alone."""
    if value is None:
        yield
        return
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def _worker_threads(num_threads: int | None):
    """While workers are spawned, OMP_NUM_THREADS is ``num_threads``: each worker's torch intra-op pool
    (SGLang's worker keeps an explicit OMP_NUM_THREADS instead of its ``cpu_count // num_gpus`` default);
    None: leave the environment alone. This process's own thread pool is already sized and stays as is."""
    return _env_var("OMP_NUM_THREADS", None if num_threads is None else str(num_threads))


def _pinned_device(device_index: int | None):
    """While workers are spawned, CUDA_VISIBLE_DEVICES names only local device ``device_index``
    (:func:`megaflow.parallel.placement.worker_visible_devices`); None: leave the environment alone."""
    visible = None if device_index is None else worker_visible_devices(device_index,
                                                                       os.environ.get("CUDA_VISIBLE_DEVICES"))
    return _env_var("CUDA_VISIBLE_DEVICES", visible)


@contextlib.contextmanager
def _worker_output(log_file: Path | None):
    """Point this process's stdout/stderr descriptors at ``log_file`` (appending) while workers are spawned
    (they inherit the descriptors); None: leave them alone."""
    if log_file is None:
        yield
        return
    log_file.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    saved = (os.dup(1), os.dup(2))
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)
