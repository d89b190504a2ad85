"""The embedded SGLang diffusion engine behind ``RolloutEngine`` (the only module importing sglang).

``SGLangEngine`` starts SGLang's scheduler/worker processes in-process (``launch_server`` without HTTP,
sglang 0.5.23 ``sglang.multimodal_gen``) and talks to them with its own ``SchedulerClient`` (not the
module-global one ``DiffGenerator`` uses), so several engines can live in one process.

Batching. SGLang denoises a request with ``num_outputs_per_prompt=k`` and a seed list as ONE batch of k,
with rollout data. Its scheduler-side dynamic batching (``batching_max_size``) merges concurrent requests
but drops ``rollout_trajectory_data`` when it splits the result, so it stays off. Instead a dispatcher
thread merges queued compatible CFG-free requests (from one or many concurrent ``generate`` callers) into
one engine call: a prompt list with one entry per sample and one seed per sample
(``extra["dynamic_batch_seeds"]``, the scheduler's own merge format), up to ``max_batch_outputs``
samples; CFG requests go one per call (SGLang's SD3 CFG path does not expand a negative prompt over a
prompt list). ``num_inflight_calls`` calls are in flight so the worker always has the next one queued.
Note: SGLang draws each step's noise as a full-batch-shaped tensor from each sample's generator, so the
sample for a seed depends on the batch it ran in (identical batches reproduce exactly).

Lifecycle. ``shutdown`` stops exactly the worker processes this engine started (PIDs and their children
recorded at start). A monitor thread polls the workers; when one dies the engine restarts them, re-applies
the current weights (replayed tensors or disk path), and every call that was in flight is retried once
(logged). ``release``/``resume`` forward SGLang's memory release on GPU; on CPU there is no accelerator
memory to free and SGLang's release crashes (unconditional torch.cuda.synchronize), so they are a
documented no-op that only flips a flag (``generate`` raises while released, as on GPU).

Logging. sglang's ``launch_server`` replaces the root logger's handlers; the adapter restores the host's
handlers after every (re)start, so records emitted by other threads during a start go to sglang's
stdout handler instead.
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import psutil
import torch
from sglang.multimodal_gen.configs.sample.sampling_params import SamplingParams
from sglang.multimodal_gen.runtime.entrypoints.control_requests import ShutdownReq
from sglang.multimodal_gen.runtime.entrypoints.post_training.io_struct import (
    GetWeightsChecksumReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromTensorCheckerReqInput,
    UpdateWeightFromTensorReqInput,
)
from sglang.multimodal_gen.runtime.entrypoints.utils import prepare_request
from sglang.multimodal_gen.runtime.launch_server import launch_server
from sglang.multimodal_gen.runtime.loader.weight_utils import compute_weights_checksum
from sglang.multimodal_gen.runtime.platforms.plugins import apply_plugin_hooks
from sglang.multimodal_gen.runtime.post_training.tensor_update_checker import compute_tensor_sha256
from sglang.multimodal_gen.runtime.scheduler_client import SchedulerClient
from sglang.multimodal_gen.runtime.server_args import ServerArgs
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

from megaflow.rollout.engine import EngineHealth, WeightUpdateResult
from megaflow.rollout.types import RolloutRequest, Trajectory

log = logging.getLogger(__name__)

FAMILY_MODEL_IDS = {"sd3": "stable-diffusion-3-medium-diffusers", "flux": "FLUX.1-dev"}
_NUM_TEXT_ENCODERS = {"sd3": 3, "flux": 2}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(kw_only=True)
class SGLangEngineConfig:
    """How to start and drive one engine."""

    model_path: str
    """Diffusers pipeline directory (model_index.json + component folders)."""
    family: str = "sd3"
    """Model family: 'sd3' or 'flux'; selects SGLang's native pipeline (see FAMILY_MODEL_IDS)."""
    engine_id: str = "sglang0"
    precision: str = "fp32"
    """Precision of DiT, VAE and text encoders ('fp32' | 'bf16' | 'fp16'); fp32 on CPU."""
    merge_requests: bool = True
    """Merge queued compatible CFG-free requests into one batched engine call."""
    max_batch_outputs: int = 16
    """Most samples per merged call (a single request larger than this still runs whole)."""
    num_inflight_calls: int = 2
    """Engine calls submitted concurrently (the worker runs one; the next is queued behind it)."""
    batch_window_ms: float = 5.0
    """How long the dispatcher waits for more requests to merge once one arrived."""
    return_model_outputs: bool = True
    """Return the per-step velocity (SGLang rollout debug mode)."""
    log_level: str = "warning"
    """SGLang's log level in the engine processes ('info' shows per-stage timings of every call)."""
    log_requests: bool = False
    """Let SGLang log each request, with per-stage timings, to its log (off: quiet)."""
    call_timeout_s: int = 600
    """A call without an answer for this long counts as an engine crash."""
    max_restarts: int = 3
    """Restarts after crashes before the engine gives up."""
    replay_weights_on_restart: bool = True
    """Keep a CPU copy of tensors pushed by update_weights and re-apply it after a restart."""
    server_kwargs: dict = field(default_factory=dict)
    """Extra sglang ServerArgs kwargs (expert escape hatch, e.g. {'num_gpus': 2})."""

    def __post_init__(self):
        if self.family not in FAMILY_MODEL_IDS:
            raise ValueError(f"family must be one of {sorted(FAMILY_MODEL_IDS)}, got {self.family!r}")
        if self.precision not in _DTYPES:
            raise ValueError(f"precision must be one of {sorted(_DTYPES)}, got {self.precision!r}")
        if self.max_batch_outputs < 1 or self.num_inflight_calls < 1:
            raise ValueError(f"max_batch_outputs and num_inflight_calls must be >= 1, got "
                             f"{self.max_batch_outputs}, {self.num_inflight_calls}")


class EngineCrashed(RuntimeError):
    """The engine's workers died (or stopped answering) and could not be restarted."""


class EngineCallFailed(RuntimeError):
    """The engine answered a call with an error (a bad request, not a crash)."""


@dataclass
class _Item:
    """One queued request and the future its caller waits on."""

    request: RolloutRequest
    future: Future
    enqueued: float


def _sampling_signature(r: RolloutRequest) -> tuple:
    """Requests with equal signatures can share one denoising batch."""
    return (r.num_steps, r.height, r.width, r.sde_type, r.noise_level, r.log_prob_no_const,
            tuple(r.sde_step_indices) if r.sde_step_indices is not None else None, r.guidance_scale,
            r.max_sequence_length)


class SGLangEngine:
    """One SGLang diffusion engine (its own worker processes), implementing ``RolloutEngine``."""

    def __init__(self, config: SGLangEngineConfig):
        self.config = config
        self.engine_id = config.engine_id
        self._lock = threading.RLock()  # guards client/processes/epoch across restarts
        self._epoch = 0
        self._num_restarts = 0
        self._released = False
        self._closed = False
        self._replay: dict[str, torch.Tensor] = {}
        self._disk_source: str | None = None
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._slots = threading.Semaphore(config.num_inflight_calls)
        self._pool = ThreadPoolExecutor(config.num_inflight_calls, thread_name_prefix=f"{self.engine_id}-call")
        t0 = time.perf_counter()
        self._server = _EngineServer.start(self._server_kwargs(), family=config.family)
        self.start_seconds = time.perf_counter() - t0
        log.info("engine %s started in %.1f s (worker pids %s)", self.engine_id, self.start_seconds,
                 self._server.pids)
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name=f"{self.engine_id}-dispatch",
                                            daemon=True)
        self._monitor = threading.Thread(target=self._monitor_loop, name=f"{self.engine_id}-monitor", daemon=True)
        self._dispatcher.start()
        self._monitor.start()

    def _server_kwargs(self) -> dict:
        c = self.config
        kwargs = dict(model_path=c.model_path, model_id=FAMILY_MODEL_IDS[c.family], backend="sglang",
                      dit_precision=c.precision, vae_precision=c.precision,
                      text_encoder_precisions=(c.precision,) * _NUM_TEXT_ENCODERS[c.family], num_gpus=1,
                      batching_max_size=1,
                      # OS-chosen free ports: SGLang's defaults (master 30005, scheduler 5555 + small
                      # random offset) collide when several engines or runs start on one host at once.
                      master_port=free_port(), scheduler_port=free_port(),
                      # an idle scheduler otherwise busy-polls a core (4.4 CPU-s per 5 s idle measured)
                      sleep_on_idle=True, log_level=c.log_level)
        kwargs.update(c.server_kwargs)
        return kwargs

    # ------------------------------------------------------------------ generate
    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        """Sample every request (thread-safe); trajectories in request order, then output index."""
        return [t for future in self.submit(requests) for t in future.result()]

    def submit(self, requests: Sequence[RolloutRequest]) -> list[Future]:
        """Queue every request (thread-safe); one future per request, resolved when the engine call that
        carries it returns (requests merged into one call resolve together)."""
        if self._closed:
            raise RuntimeError(f"engine {self.engine_id} is shut down")
        if self._released:
            raise RuntimeError(f"engine {self.engine_id} is released: call resume() before generate()")
        for r in requests:
            if self.config.family == "flux" and r.do_cfg:
                raise ValueError(f"request {r.request_id}: do_cfg (true CFG) is not supported for FLUX; "
                                 "guidance_scale is FLUX's embedded guidance")
        items = [_Item(r, Future(), time.perf_counter()) for r in requests]
        for item in items:
            self._queue.put(item)
        return [item.future for item in items]

    def _dispatch_loop(self) -> None:
        """Collect queued requests, merge compatible ones into calls, keep num_inflight_calls running."""
        window = self.config.batch_window_ms / 1000
        while True:
            first = self._queue.get()
            if first is None:
                return
            items, deadline = [first], time.perf_counter() + window
            while sum(i.request.num_outputs for i in items) < self.config.max_batch_outputs:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.perf_counter()))
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                items.append(item)
            for call in self._plan_calls(items):
                self._slots.acquire()
                self._pool.submit(self._run_call, call)

    def _plan_calls(self, items: list[_Item]) -> list[list[_Item]]:
        """Group items: compatible CFG-free requests share a call up to max_batch_outputs samples."""
        calls: list[list[_Item]] = []
        open_calls: dict[tuple, list[_Item]] = {}
        for item in items:
            r = item.request
            if r.do_cfg or not self.config.merge_requests:
                calls.append([item])
                continue
            key = _sampling_signature(r)
            call = open_calls.get(key)
            if call is not None and sum(i.request.num_outputs for i in call) + r.num_outputs <= \
                    self.config.max_batch_outputs:
                call.append(item)
            else:
                call = [item]
                open_calls[key] = call
                calls.append(call)
        return calls

    def _run_call(self, call: list[_Item]) -> None:
        try:
            for attempt in (0, 1):
                epoch = self._epoch
                try:
                    trajectories = self._server_call(call)
                    break
                except EngineCallFailed as e:  # the engine answered with an error: not a crash
                    raise RuntimeError(f"engine {self.engine_id}: {e}") from e
                except Exception as e:  # transport failure or timeout: the workers died or hung
                    if attempt == 1 or self._closed:
                        raise
                    self._recover(epoch, f"{type(e).__name__}: {e}")
                    # logged after the restart: while sglang's launch_server runs, the root logger's
                    # handlers are sglang's (restored by _EngineServer.start), so records would go astray
                    log.warning("engine %s: call of %d request(s) failed (%s: %s); engine restarted, "
                                "retrying once", self.engine_id, len(call), type(e).__name__, e)
            start = 0
            for item in call:
                k = item.request.num_outputs
                item.future.set_result(trajectories[start:start + k])
                start += k
        except BaseException as e:  # noqa: BLE001 - every waiting caller must wake up
            for item in call:
                if not item.future.done():
                    item.future.set_exception(e)
        finally:
            self._slots.release()

    def _server_call(self, call: list[_Item]) -> list[Trajectory]:
        requests = [i.request for i in call]
        queued = time.perf_counter() - min(i.enqueued for i in call)
        with self._lock:
            server = self._server
        if server is None:
            raise RuntimeError(f"engine {self.engine_id} is shut down")
        t0 = time.perf_counter()
        trajectories = server.generate(requests, return_model_outputs=self.config.return_model_outputs,
                                       log_request=self.config.log_requests, timeout_s=self.config.call_timeout_s)
        seconds = time.perf_counter() - t0
        for t in trajectories:
            t.engine_id = self.engine_id
            t.timings.update(call_s=seconds, queue_s=queued, batch_size=float(len(trajectories)))
        return trajectories

    # ------------------------------------------------------------------ crash handling
    def _monitor_loop(self) -> None:
        while not self._closed:
            time.sleep(0.5)
            with self._lock:
                server, epoch = self._server, self._epoch
            dead = server.dead_workers() if server is not None else []
            if dead and not self._closed:
                try:
                    self._recover(epoch, f"worker process(es) exited: {dead}")
                except Exception:  # noqa: BLE001 - logged; callers see their own errors
                    log.exception("engine %s: restart failed", self.engine_id)

    def _recover(self, epoch_seen: int, reason: str) -> None:
        """Restart the workers unless someone already did since ``epoch_seen``; re-apply weights."""
        with self._lock:
            if self._epoch != epoch_seen or self._closed:
                return
            if self._num_restarts >= self.config.max_restarts:
                raise EngineCrashed(f"engine {self.engine_id} crashed ({reason}) after "
                                    f"{self._num_restarts} restarts; giving up")
            log.warning("engine %s: restarting after crash (%s)", self.engine_id, reason)
            old, self._server = self._server, None
            if old is not None:  # None when an earlier restart failed half-way
                old.stop()  # kills its workers and closes the client: blocked calls fail and retry
            t0 = time.perf_counter()
            self._server = _EngineServer.start(self._server_kwargs(), family=self.config.family)
            replays = []
            if self._disk_source is not None:
                replays.append(self._server.update_from_disk(self._disk_source))
            if self._replay:
                replays.append(self._server.update_from_tensors(list(self._replay.items())))
            failed = [message for ok, message in replays if not ok]
            if failed:  # never sample with stale weights
                raise EngineCrashed(f"engine {self.engine_id}: weights not restored after restart: {failed}")
            self._num_restarts += 1
            self._epoch += 1
            log.warning("engine %s: restarted in %.1f s (restart %d, worker pids %s)", self.engine_id,
                        time.perf_counter() - t0, self._num_restarts, self._server.pids)

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       verify: bool = True) -> WeightUpdateResult:
        """Push DiT tensors (diffusers names) as one flattened bucket; ``verify``: then check each by SHA-256
        (SGLang skips unknown names and still reports success, so without it such a name goes unnoticed)."""
        dtype = _DTYPES[self.config.precision]
        named = [(n, t.detach().to("cpu", dtype).contiguous()) for n, t in named_tensors]
        t0 = time.perf_counter()
        with self._lock:
            ok, message = self._server.update_from_tensors(named, verify=verify)
            if ok and self.config.replay_weights_on_restart:
                self._replay.update({n: t.clone() for n, t in named})
        return WeightUpdateResult(ok=ok, num_tensors=len(named), message=message,
                                  num_bytes=sum(t.numel() * t.element_size() for _, t in named),
                                  seconds=time.perf_counter() - t0)

    def load_bucket(self, bucket, *, verify: bool = True) -> WeightUpdateResult:
        """One bridge bucket (megaflow.bridge.buckets.Bucket) as one tensor update (verified if ``verify``)."""
        return self.update_weights(bucket.unpack(), verify=verify)

    def verify_weights(self, expected_sha256: dict[str, str]) -> tuple[bool, str]:
        """Ask the engine to re-hash tensors by name (SGLang's update-weights checker)."""
        with self._lock:
            return self._server.verify(expected_sha256)

    def update_weights_from_disk(self, path: str) -> WeightUpdateResult:
        """Reload the DiT from a pipeline directory with a ``transformer/`` folder (all-or-nothing)."""
        t0 = time.perf_counter()
        with self._lock:
            ok, message = self._server.update_from_disk(str(path))
            if ok:
                self._disk_source, self._replay = str(path), {}
        return WeightUpdateResult(ok=ok, message=message, seconds=time.perf_counter() - t0)

    def checksum(self) -> str:
        with self._lock:
            return self._server.checksum()

    # ------------------------------------------------------------------ lifecycle
    def release(self) -> None:
        """GPU: SGLang release_memory_occupation. CPU: no-op (nothing to free); generate raises until resume."""
        with self._lock:
            if torch.cuda.is_available():
                self._server.memory_occupation(release=True)
            self._released = True

    def resume(self) -> None:
        with self._lock:
            if torch.cuda.is_available():
                self._server.memory_occupation(release=False)
            self._released = False

    def health(self) -> EngineHealth:
        with self._lock:
            server = self._server
        if server is None:
            return EngineHealth(alive=False, engine_id=self.engine_id, num_restarts=self._num_restarts,
                                detail="shut down" if self._closed else "restarting")
        dead = server.dead_workers()
        alive = not dead and server.ping()
        return EngineHealth(alive=alive, engine_id=self.engine_id, num_restarts=self._num_restarts,
                            worker_pids=list(server.pids),
                            detail="ok" if alive else f"dead workers {dead}" if dead else "no answer to ping")

    def shutdown(self) -> None:
        """Stop the dispatcher, the monitor and exactly the worker processes this engine started."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._dispatcher.join(timeout=10)
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.stop()
        self._monitor.join(timeout=5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def weights_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The digest ``checksum()`` reports for a DiT holding exactly these tensors (sglang's algorithm)."""
    return compute_weights_checksum(list(named_tensors))


# Set by torchrun / torch elastic for the TRAINER's process group. Engine workers inherit the
# environment and would otherwise join (and wait forever for) that world instead of their own.
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def _without_launcher_env(quiet: bool = True):
    """Hide the launcher's distributed env vars while engine worker processes are spawned; with ``quiet``
    the workers also draw no per-call progress bars (tqdm's TQDM_DISABLE)."""
    saved = {k: os.environ.pop(k) for k in list(os.environ)
             if k in _LAUNCHER_ENV or k.startswith("TORCHELASTIC_")}
    added = {"TQDM_DISABLE": "1"} if quiet and "TQDM_DISABLE" not in os.environ else {}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)
        os.environ.update(saved)


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


# ---------------------------------------------------------------------- the sglang side
class _EngineServer:
    """One running set of SGLang worker processes and the client that talks to them (no threads)."""

    def __init__(self, server_args, processes, client, family: str):
        self.server_args, self.processes, self.client, self.family = server_args, processes, client, family
        self.pids = [p.pid for p in processes]
        # Children the workers spawned: ours too, so shutdown stops them (psutil guards PID reuse).
        self.children = [c for pid in self.pids for c in psutil.Process(pid).children(recursive=True)]

    @classmethod
    def start(cls, kwargs: dict, *, family: str) -> _EngineServer:
        # launch_server replaces the root logger's handlers (sglang configure_logger); an embedded engine
        # must not wipe the host's logging setup, so it is restored afterwards.
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        try:
            apply_plugin_hooks()
            server_args = ServerArgs.from_kwargs(**kwargs)
            with _without_launcher_env():
                processes = launch_server(server_args, launch_http_server=False)
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)
        client = SchedulerClient()
        client.initialize(server_args)
        return cls(server_args, processes, client, family)

    def dead_workers(self) -> list[int]:
        return [p.pid for p in self.processes if not p.is_alive()]

    def ping(self) -> bool:
        return self.client.context is not None and self.client.ping()

    def _control(self, req, timeout_s: int = 600):
        ob = self.client.forward(req, timeout_ms=timeout_s * 1000)
        return ob.output, ob.error

    # generation
    def generate(self, requests: list[RolloutRequest], *, return_model_outputs: bool, log_request: bool,
                 timeout_s: int) -> list[Trajectory]:
        req = self._build_req(requests, return_model_outputs, log_request)
        t0 = time.perf_counter()
        ob = self.client.forward(req, timeout_ms=timeout_s * 1000)
        seconds = time.perf_counter() - t0
        if ob.error:
            raise EngineCallFailed(ob.error)
        trajectories = _to_trajectories(requests, ob)
        stages = {f"{k}_s": v / 1000 for k, v in (ob.metrics.stages if ob.metrics else {}).items()}
        for t in trajectories:
            t.timings.update(stages, forward_s=seconds)
        return trajectories

    def _build_req(self, requests: list[RolloutRequest], return_model_outputs: bool, log_request: bool):
        r0 = requests[0]
        seeds = [s for r in requests for s in r.output_seeds()]
        merged = len(requests) > 1
        sde_type = r0.sde_type
        kwargs = dict(
            prompt=r0.prompt, seed=seeds[0] if (merged or len(seeds) == 1) else seeds,
            num_outputs_per_prompt=1 if merged else r0.num_outputs, num_inference_steps=r0.num_steps,
            height=r0.height, width=r0.width,
            guidance_scale=r0.guidance_scale if (r0.do_cfg or self.family == "flux") else 1.0,
            generator_device="cpu", rollout=True, rollout_sde_type=sde_type,
            rollout_noise_level=r0.noise_level,
            rollout_log_prob_no_const=r0.log_prob_no_const or sde_type == "ode",  # SGLang asserts it for ODE
            rollout_sde_step_indices=list(r0.sde_step_indices) if r0.sde_step_indices is not None else None,
            rollout_return_dit_trajectory=True, rollout_return_denoising_env=True,
            rollout_debug_mode=return_model_outputs, save_output=False, suppress_logs=not log_request)
        if r0.do_cfg:
            kwargs["negative_prompt"] = r0.negative_prompt
        if r0.max_sequence_length is not None:
            kwargs["max_sequence_length"] = r0.max_sequence_length
        sampling = SamplingParams.from_user_sampling_params_args(
            self.server_args.model_path, server_args=self.server_args, **kwargs)
        req = prepare_request(server_args=self.server_args, sampling_params=sampling)
        if merged:  # the scheduler's own merge format: one prompt and one seed per sample
            assert not r0.do_cfg, "CFG requests are never merged"
            req.prompt = [r.prompt for r in requests for _ in range(r.num_outputs)]
            req.extra = dict(req.extra, dynamic_batch_seeds=seeds)
        return req

    # weights
    def update_from_tensors(self, named: list[tuple[str, torch.Tensor]], *, verify: bool = True) -> tuple[bool, str]:
        """One flattened bucket for the 'transformer' module; the payload is serialized per send
        (a CPU payload lives in shared memory that the worker can open only once). ``verify``: SHA-256
        of every tensor here and in the engine afterwards."""
        bucket = FlattenedTensorBucket(named_tensors=named)
        payload = {"transformer": {"flattened_tensor": bucket.get_flattened_tensor(),
                                   "metadata": bucket.get_metadata()}}
        serialized = MultiprocessingSerializer.serialize(payload, output_str=True)
        out, error = self._control(UpdateWeightFromTensorReqInput(
            serialized_named_tensors=[serialized], load_format="flattened_bucket",
            target_modules=["transformer"]))
        if error or not (out or {}).get("success"):
            return False, f"update_weights_from_tensor failed: {error or out}"
        if not verify:
            return True, f"updated {len(named)} tensors (not verified)"
        # SGLang skips unknown names and still reports success: verify every tensor by SHA-256.
        ok, message = self.verify({n: compute_tensor_sha256(t) for n, t in named})
        if not ok:
            return False, f"weights not verified after update: {message}"
        return True, f"updated and verified {len(named)} tensors"

    def verify(self, expected_sha256: dict[str, str]) -> tuple[bool, str]:
        """The engine re-hashes the named DiT tensors it holds and compares with ``expected_sha256``."""
        out, error = self._control(UpdateWeightFromTensorCheckerReqInput(
            target_module="transformer", expected_named_tensors_sha256=expected_sha256))
        if error or not (out or {}).get("success"):
            return False, str(error or (out or {}).get("message"))
        return True, f"{len(expected_sha256)} tensors verified"

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


def _rows(kwargs: dict | None, batch: int, index: int, prefix: str = "") -> dict[str, torch.Tensor]:
    """Sample ``index``'s slice of batched DiT kwargs (dim 0 == batch, or 1 = shared by all samples)."""
    out = {}
    for name, value in (kwargs or {}).items():
        if not isinstance(value, torch.Tensor):
            continue
        if value.dim() >= 1 and value.shape[0] == batch:
            value = value[index]
        elif value.dim() >= 1 and value.shape[0] == 1:
            value = value[0]
        out[prefix + name] = value
    return out


def _to_trajectories(requests: list[RolloutRequest], ob) -> list[Trajectory]:
    """Split one engine answer (a batch of B samples) into per-sample Trajectories."""
    rtd = ob.rollout_trajectory_data
    if rtd is None or rtd.dit_trajectory is None or rtd.rollout_log_probs is None:
        raise EngineCallFailed("engine returned no rollout data (is SGLang's native pipeline in use? "
                               "check model_id/backend)")
    latents = rtd.dit_trajectory.latents.float()
    sigmas = rtd.dit_trajectory.sigmas.float()
    log_probs = rtd.rollout_log_probs.float()
    debug = rtd.rollout_debug_tensors
    model_outputs = debug.rollout_model_outputs.float() if debug is not None else None
    images = ob.output
    env = rtd.denoising_env
    batch = latents.shape[0]
    expected = sum(r.num_outputs for r in requests)
    assert batch == expected == log_probs.shape[0], (batch, expected, tuple(log_probs.shape))
    out, b = [], 0
    for r in requests:
        for j, seed in enumerate(r.output_seeds()):
            cond = {}
            if env is not None:
                cond.update(_rows(env.image_kwargs, batch, b))
                cond.update(_rows(env.pos_cond_kwargs, batch, b))
                cond.update(_rows(env.neg_cond_kwargs, batch, b, prefix="negative_"))
                if isinstance(env.guidance, torch.Tensor):
                    cond.update(_rows({"guidance": env.guidance}, batch, b))
            out.append(Trajectory(
                request_id=r.request_id, index=j, prompt=r.prompt, seed=seed, latents=latents[b],
                sigmas=sigmas, log_probs=log_probs[b], sde_mask=r.sde_mask(), sde_type=r.sde_type,
                noise_level=r.noise_level, log_prob_no_const=r.log_prob_no_const or r.sde_type == "ode",
                guidance_scale=r.guidance_scale, do_cfg=r.do_cfg, conditioning=cond,
                model_outputs=model_outputs[b] if model_outputs is not None else None,
                image=images[b].float() if (r.return_images and images is not None) else None))
            b += 1
    return out
