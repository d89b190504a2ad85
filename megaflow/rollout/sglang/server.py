"""SGLang's worker processes: start them, talk to them (generation and control requests), stop exactly them.

``EngineServer.start`` runs ``launch_server`` without HTTP (or hands a warm worker its server args); with a
``log_file`` everything the workers print goes there.
"""
from __future__ import annotations

import logging
import shutil
import socket
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import psutil
import torch
from sglang.multimodal_gen.runtime.entrypoints.control_requests import ShutdownReq
from sglang.multimodal_gen.runtime.entrypoints.post_training.io_struct import (
    GetWeightsChecksumReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromTensorCheckerReqInput,
)
from sglang.multimodal_gen.runtime.loader.weight_utils import compute_weights_checksum
from sglang.multimodal_gen.runtime.platforms.plugins import apply_plugin_hooks
from sglang.multimodal_gen.runtime.scheduler_client import SchedulerClient
from sglang.multimodal_gen.runtime.server_args import ServerArgs

from megaflow.checksum import DEFAULT
from megaflow.rollout.sglang import plugin
from megaflow.rollout.sglang.spawning import spawn_settings
from megaflow.rollout.sglang.weights import flatten, update_request
from megaflow.rollout.sglang.wire import EngineCallFailed, build_request, to_trajectories
from megaflow.rollout.types import RolloutRequest, Trajectory

log = logging.getLogger(__name__)


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The digest ``checksum()`` reports for a DiT holding exactly these tensors (sglang's algorithm)."""
    return compute_weights_checksum(list(named_tensors))


def _own_sockets(server_args, socket_dir: str) -> None:
    """Register ``socket_dir`` as this engine's private directory and check that its scheduler endpoints moved
    there (megaflow's SGLang plugin must have hooked ``ServerArgs.scheduler_endpoint_for`` in this process)."""
    plugin.own_sockets(server_args.scheduler_port, socket_dir)
    public = [e for e in server_args.scheduler_endpoints if e.startswith(plugin.LOOPBACK_TCP)]
    if public:
        raise RuntimeError(f"the engine's scheduler would listen on {public[0]}: megaflow's SGLang plugin is not "
                           "active in this process (SGLang's hooks were applied before the engine started)")


def _disown_sockets(server_args, socket_dir: str | None) -> None:
    if server_args is not None:
        plugin.disown_sockets(server_args.scheduler_port)
    if socket_dir is not None:
        shutil.rmtree(socket_dir, ignore_errors=True)


def _launch(server_args) -> list:
    """SGLang's own start of the workers, without HTTP (imported here: a run whose workers started warm never
    needs the module, its HTTP server and its orchestrator: ~1 s of imports)."""
    from sglang.multimodal_gen.runtime.launch_server import launch_server
    return launch_server(server_args, launch_http_server=False)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (picked by the OS)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_processes_alive(pids: Sequence[int]) -> list[int]:
    """The PIDs among ``pids`` that are still running (not zombies): for tests and health checks."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


class EngineServer:
    """One running set of SGLang worker processes and the client that talks to them (no threads)."""

    def __init__(self, server_args, processes, client, family: str, socket_dir: str | None = None):
        self.server_args, self.processes, self.client, self.family = server_args, processes, client, family
        self.socket_dir = socket_dir  # the workers' private rendezvous and ipc sockets (``start``), removed by ``stop``
        self.pids = [p.pid for p in processes]
        self._kept_slots: dict[str, torch.Tensor] = {}
        """Staging-slot key -> the tensor whose memory these workers keep under it (``update_from_bucket``)."""
        # Children the workers spawned: ours too, so shutdown stops them (psutil guards PID reuse).
        self.children = [c for pid in self.pids for c in psutil.Process(pid).children(recursive=True)]

    @classmethod
    def start(cls, kwargs: dict, *, family: str, log_file: Path | None = None, device_index: int | None = None,
              num_threads: int | None = None, checksum: str = DEFAULT, warm=None) -> EngineServer:
        """Start the workers (``kwargs``: sglang ServerArgs) pinned to ``device_index``, ``num_threads`` each, hashing
        with ``checksum``, output to ``log_file``; ``warm``: a WarmWorker that becomes the worker (one-rank engine)."""
        if warm is not None and int(kwargs.get("num_gpus", 1)) != 1:
            warm.discard()
            raise ValueError("a warm worker serves a one-rank engine only (num_gpus = 1)")
        # launch_server replaces the root logger's handlers (sglang configure_logger); an embedded engine
        # must not wipe the host's logging setup, so it is restored afterwards.
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        # 0700: the workers' rendezvous and ipc sockets (a warm worker was told its own when it was spawned)
        socket_dir = warm.socket_dir if warm is not None else tempfile.mkdtemp(prefix="megaflow-engine-")
        server_args = None
        try:
            with spawn_settings(log_file=log_file, device_index=device_index, num_threads=num_threads,
                                checksum=checksum, socket_dir=socket_dir):
                apply_plugin_hooks()
                server_args = ServerArgs.from_kwargs(**kwargs)
                _own_sockets(server_args, socket_dir)
                processes = _launch(server_args) if warm is None else warm.launch(server_args)
        except BaseException:
            if warm is not None:
                warm.discard()
            _disown_sockets(server_args, socket_dir)
            raise
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)
        client = SchedulerClient()
        client.initialize(server_args)
        return cls(server_args, processes, client, family, socket_dir)

    def dead_workers(self) -> list[int]:
        return [p.pid for p in self.processes if not p.is_alive()]

    def ping(self) -> bool:
        return self.client.context is not None and self.client.ping()

    def _control(self, req, timeout_s: int = 600):
        ob = self.client.forward(req, timeout_ms=timeout_s * 1000)
        return ob.output, ob.error

    # generation
    def generate(self, requests: list[RolloutRequest], *, log_request: bool, timeout_s: int) -> list[Trajectory]:
        req = build_request(self.server_args, self.family, requests, log_request=log_request)
        t0 = time.perf_counter()
        ob = self.client.forward(req, timeout_ms=timeout_s * 1000)
        seconds = time.perf_counter() - t0
        if ob.error:
            raise EngineCallFailed(ob.error)
        trajectories = to_trajectories(requests, ob)
        stages = {f"{k}_s": v / 1000 for k, v in (ob.metrics.stages if ob.metrics else {}).items()}
        for t in trajectories:
            t.timings.update(stages, forward_s=seconds)
        return trajectories


    # weights
    def update_from_bucket(self, flat: torch.Tensor, metadata: Sequence, *, keep: str | None = None,
                           digests: dict[str, str] | None = None) -> tuple[bool, str]:
        """Load one flattened bucket into the DiT (``keep``: a staging slot's key, named rather than sent when held);
        ``digests``: checked in the same request (one rank) or by a check request after. Without them: unverified."""
        in_request = digests if digests and self.single_rank else None
        kept = keep is not None and self._kept_slots.pop(keep, None) is flat  # forgotten unless this load succeeds
        out, error = self._control(update_request(flat, metadata, keep=keep, kept=kept, digests=in_request))
        if error or not (out or {}).get("success"):
            return False, f"update_weights_from_tensor failed: {error or out}"
        if keep is not None:  # the workers hold this memory under the key now (StagingSlots: the same tensor
            self._kept_slots[keep] = flat  # object for as long as the slot keeps its memory)
        if digests and in_request is None:
            ok, message = self.verify(digests)
            return ok, message if ok else f"weights not verified after update: {message}"
        return True, str((out or {}).get("message")) if digests else f"updated {len(metadata)} tensors (not verified)"

    @property
    def single_rank(self) -> bool:
        """The engine runs in one worker process (no tensor or sequence parallel ranks)."""
        return int(getattr(self.server_args, "num_gpus", 1) or 1) == 1

    def update_lora_from_tensors(self, named: list[tuple[str, torch.Tensor]], *, alpha: float,
                                 rank: int) -> tuple[bool, str]:
        """LoRA adapters (PEFT names) as one bucket through ``weight_update_mode="lora_merge"``: each update replaces
        every named layer's adapter and merges ``base + alpha / rank * B @ A``."""
        flat, metadata = flatten(named)
        out, error = self._control(update_request(flat, metadata, lora=(alpha, rank)))
        if error or not (out or {}).get("success"):
            return False, f"update_weights_from_tensor(lora_merge) failed: {error or out}"
        return True, str((out or {}).get("message", ""))

    def verify(self, expected_digests: dict[str, str]) -> tuple[bool, str]:
        """The engine re-hashes the named DiT tensors it holds (with the checksum its workers were started with,
        see ``start``) and compares with ``expected_digests`` (SGLang's field name says sha256 whatever the
        algorithm: megaflow's plugin replaces its hash)."""
        out, error = self._control(UpdateWeightFromTensorCheckerReqInput(
            target_module="transformer", expected_named_tensors_sha256=expected_digests))
        if error or not (out or {}).get("success"):
            return False, str(error or (out or {}).get("message"))
        return True, f"{len(expected_digests)} tensors verified"

    def update_from_disk(self, path: str) -> tuple[bool, str]:
        out, error = self._control(UpdateWeightFromDiskReqInput(model_path=path, target_modules=["transformer"]))
        ok = bool((out or {}).get("success")) and not error
        return ok, str((out or {}).get("message") or error)

    def checksum(self) -> str:
        out, error = self._control(GetWeightsChecksumReqInput(module_names=["transformer"]))
        if error or not out or out.get("transformer") in (None, "not_found"):
            raise RuntimeError(f"get_weights_checksum failed: {error or out}")
        return out["transformer"]

    def memory_occupation(self, *, release: bool) -> None:
        req = ReleaseMemoryOccupationReqInput() if release else ResumeMemoryOccupationReqInput()
        out, error = self._control(req)
        if error or not (out or {}).get("success"):
            raise RuntimeError(f"{'release' if release else 'resume'}_memory_occupation failed: {error or out}")

    def stop(self) -> None:
        """Graceful shutdown if all workers live, then terminate/kill exactly our processes."""
        if not self.dead_workers():
            try:
                self.client.forward(ShutdownReq(), timeout_ms=5000)
            except Exception as e:  # noqa: BLE001 - we kill below anyway
                log.debug("graceful shutdown request failed: %s", e)
        for p in self.processes:
            p.join(timeout=5)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        for child in self.children:
            try:
                if child.is_running():
                    child.kill()
            except psutil.NoSuchProcess:
                pass
        self.client.close()  # wakes any thread blocked in recv (ContextTerminated) so it can retry
        _disown_sockets(self.server_args, self.socket_dir)
