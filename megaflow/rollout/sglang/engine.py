"""``SGLangEngine``: the embedded SGLang diffusion engine behind ``RolloutEngine``.

Invariant: the engine calls are a function of the submitted request lists alone (never of the clock), so the same
requests give the same samples on any machine load. Design notes: docs/design/rollout.md.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from megaflow.bridge.base import WeightUpdateResult
from megaflow.checksum import DEFAULT, tensor_digest
from megaflow.families import card
from megaflow.rollout.engine import EngineHealth
from megaflow.rollout.sglang.config import SGLangEngineConfig, check_model_dir
from megaflow.rollout.sglang.server import EngineServer, free_port
from megaflow.rollout.sglang.replay import ReplayStore
from megaflow.rollout.sglang.weights import flatten
from megaflow.rollout.sglang.wire import EngineCallFailed
from megaflow.rollout.types import RolloutRequest, Trajectory

log = logging.getLogger(__name__)


def lora_engine_name(peft_name: str) -> str:
    """The engine's parameter name of a PEFT adapter tensor: SGLang's LoRA layer holds A and B as its
    ``lora_A`` / ``lora_B`` parameters (``...to_q.lora_A.weight`` -> ``...to_q.lora_A``)."""
    return peft_name.removesuffix(".weight")


class EngineCrashed(RuntimeError):
    """The engine's workers died (or stopped answering) and could not be restarted."""


@dataclass
class _Item:
    """One request and the future its caller waits on."""

    request: RolloutRequest
    future: Future
    enqueued: float


def _sampling_signature(r: RolloutRequest) -> tuple:
    """Requests with equal signatures can share one denoising batch."""
    return (r.num_steps, r.height, r.width, r.num_frames, r.sde_type, r.noise_level, r.log_prob_no_const,
            tuple(r.sde_step_indices) if r.sde_step_indices is not None else None, r.guidance_scale,
            r.max_sequence_length, r.return_model_outputs)


def plan_calls(requests: Sequence[RolloutRequest], *, max_outputs: int, merge: bool = True) -> list[list[int]]:
    """The engine calls of one ``submit``, as request indices: in request order, each compatible CFG-free
    request joins the open call of its signature while that stays within ``max_outputs`` samples, else opens a
    new one; CFG requests (and every request with ``merge`` off) run alone. A function of the list alone."""
    calls: list[list[int]] = []
    sizes: list[int] = []  # samples of each call
    open_call: dict[tuple, int] = {}  # signature -> the index of its open call
    for j, r in enumerate(requests):
        key = None if r.do_cfg or not merge else _sampling_signature(r)
        c = open_call.get(key) if key is not None else None
        if c is not None and sizes[c] + r.num_outputs <= max_outputs:
            calls[c].append(j)
            sizes[c] += r.num_outputs
            continue
        calls.append([j])
        sizes.append(r.num_outputs)
        if key is not None:
            open_call[key] = len(calls) - 1
    return calls


class SGLangEngine:
    """One SGLang diffusion engine (its own worker processes): a ``RolloutEngine`` (``Sampler`` and ``WeightTarget``)
    that also merges LoRA adapters (``bridge.lora.LoRATarget``)."""

    def __init__(self, config: SGLangEngineConfig, *, warm=None):
        """Start the engine (``warm``: its worker, started ahead by megaflow.rollout.sglang.warm.WarmWorker with
        this config's spawn settings; used once: a restart starts afresh)."""
        try:
            check_model_dir(config)  # before any worker loads it
        except ValueError:
            if warm is not None:
                warm.discard()
            raise
        self.config = config
        self.engine_id = config.engine_id
        self._lock = threading.RLock()  # guards client/processes/epoch across restarts
        self._epoch = 0
        self._num_restarts = 0
        self._released = False
        self._closed = False
        self._replay = ReplayStore()
        self._queue: queue.Queue[list[_Item] | None] = queue.Queue()
        self._slots = threading.Semaphore(config.num_inflight_calls)
        self._pool = ThreadPoolExecutor(config.num_inflight_calls, thread_name_prefix=f"{self.engine_id}-call")
        t0 = time.perf_counter()
        self._server = self._start_server(warm)
        self.start_seconds = time.perf_counter() - t0
        log.info("engine %s started in %.1f s (worker pids %s)", self.engine_id, self.start_seconds,
                 self._server.pids)
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name=f"{self.engine_id}-dispatch",
                                            daemon=True)
        self._monitor = threading.Thread(target=self._monitor_loop, name=f"{self.engine_id}-monitor", daemon=True)
        self._dispatcher.start()
        self._monitor.start()

    @property
    def log_file(self) -> Path | None:
        """Where the worker processes' output goes (None: this process's terminal)."""
        return Path(self.config.log_dir) / f"{self.engine_id}.log" if self.config.log_dir else None

    def _start_server(self, warm=None) -> EngineServer:
        return EngineServer.start(self._server_kwargs(), family=self.config.family, log_file=self.log_file,
                                  device_index=self.config.device_index, num_threads=self.config.num_threads,
                                  checksum=self.config.checksum, warm=warm)

    def _server_kwargs(self) -> dict:
        c = self.config
        kwargs = dict(model_path=c.model_path, model_id=card(c.family).sglang_model_id, backend="sglang",
                      dit_precision=c.precision, vae_precision=c.precision,
                      text_encoder_precisions=(c.precision,) * card(c.family).text_encoders, num_gpus=1,
                      batching_max_size=1,
                      # OS-chosen free ports: SGLang's defaults (master 30005, scheduler 5555 + small
                      # random offset) collide when several engines or runs start on one host at once.
                      master_port=free_port(), scheduler_port=free_port(),
                      # an idle scheduler otherwise busy-polls a core (4.4 CPU-s per 5 s idle measured)
                      sleep_on_idle=True, log_level=c.log_level, trust_remote_code=c.trust_remote_code)
        kwargs.update(c.server_kwargs)
        return kwargs

    # ------------------------------------------------------------------ generate
    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        """Sample every request (thread-safe); trajectories in request order, then output index."""
        return [t for future in self.submit(requests) for t in future.result()]

    def submit(self, requests: Sequence[RolloutRequest]) -> list[Future]:
        """Queue every request (thread-safe); one future per request, resolved when the engine call that
        carries it returns (requests merged into one call resolve together). The calls are planned from
        ``requests`` alone (``plan_calls``), so the same list always runs in the same batches."""
        if self._closed:
            raise RuntimeError(f"engine {self.engine_id} is shut down")
        if self._released:
            raise RuntimeError(f"engine {self.engine_id} is released: call resume() before generate()")
        family = card(self.config.family)
        for r in requests:
            if family.embedded_guidance and r.do_cfg:
                raise ValueError(f"request {r.request_id}: do_cfg (true CFG) is not supported for {family.title}; "
                                 f"guidance_scale is {family.title}'s embedded guidance")
        items = [_Item(r, Future(), time.perf_counter()) for r in requests]
        for call in plan_calls([i.request for i in items], max_outputs=self.config.max_batch_outputs,
                               merge=self.config.merge_requests):
            self._queue.put([items[j] for j in call])
        return [item.future for item in items]

    def _dispatch_loop(self) -> None:
        """Run the planned calls in the order they were queued, num_inflight_calls at once."""
        while True:
            call = self._queue.get()
            if call is None:
                return
            self._slots.acquire()
            self._pool.submit(self._run_call, call)

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
                    # handlers are sglang's (restored by EngineServer.start), so records would go astray
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
        trajectories = server.generate(requests, log_request=self.config.log_requests,
                                       timeout_s=self.config.call_timeout_s)
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
            self._server = self._start_server()
            failed = [message for ok, message in self._replay.apply(self._server) if not ok]
            if failed:  # never sample with stale weights
                raise EngineCrashed(f"engine {self.engine_id}: weights not restored after restart: {failed}")
            self._num_restarts += 1
            self._epoch += 1
            log.warning("engine %s: restarted in %.1f s (restart %d, worker pids %s)", self.engine_id,
                        time.perf_counter() - t0, self._num_restarts, self._server.pids)

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       verify: bool = True) -> WeightUpdateResult:
        """Push DiT tensors (diffusers names) as one flattened bucket, in their own dtype; ``verify``: check each by its
        digest (SGLang skips unknown names and still reports success)."""
        named = list(named_tensors)  # flattened and hashed: read twice
        flat, metadata = flatten(named)
        digests = {n: tensor_digest(t, self.config.checksum) for n, t in named} if verify else None
        return self._load(flat, metadata, digests=digests)

    def update_lora(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, alpha: float, rank: int,
                    verify: bool = True) -> WeightUpdateResult:
        """Set the DiT's LoRA adapters (PEFT names), merged as base + alpha / rank * B @ A, replacing the previous;
        ``verify``: re-hash every adapter tensor against what was sent."""
        named = [(lora_engine_name(n), t.detach().to("cpu").contiguous()) for n, t in named_tensors]
        t0 = time.perf_counter()
        with self._lock:
            ok, message = self._server.update_lora_from_tensors(named, alpha=alpha, rank=rank)
            if ok and verify:
                ok, message = self._server.verify({n: tensor_digest(t, self.config.checksum) for n, t in named})
            if ok and self.config.replay_weights_on_restart:
                self._replay.keep_lora(named, alpha, rank)
        return WeightUpdateResult(ok=ok, num_tensors=len(named), message=message,
                                  num_bytes=sum(t.numel() * t.element_size() for _, t in named),
                                  seconds=time.perf_counter() - t0)

    def load_bucket(self, bucket, *, digests: dict[str, str] | None = None, checksum: str = DEFAULT
                    ) -> WeightUpdateResult:
        """One bridge bucket as one update, without a copy (shared memory / CUDA IPC); ``digests``: checked in the same
        request. Kept for ``replay`` as views of its staging slot, else copied to host tensors."""
        if digests and checksum != self.config.checksum:
            return WeightUpdateResult(ok=False, message=self._other_checksum(checksum))
        return self._load(bucket.flat, bucket.metadata, digests=digests, slot=getattr(bucket, "slot", None))

    def _load(self, flat: torch.Tensor, metadata: list, *, digests: dict[str, str] | None,
              slot: str | None = None) -> WeightUpdateResult:
        t0 = time.perf_counter()
        with self._lock:
            ok, message = self._server.update_from_bucket(flat, metadata, keep=slot, digests=digests)
            if ok and self.config.replay_weights_on_restart:
                views = {m.name: flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape) for m in metadata}
                self._replay.keep(views, alias=slot is not None)
        return WeightUpdateResult(ok=ok, num_tensors=len(metadata), message=message,
                                  num_bytes=sum(int(m.numel) for m in metadata), seconds=time.perf_counter() - t0)

    def _other_checksum(self, checksum: str) -> str:
        return f"engine {self.engine_id} hashes with {self.config.checksum}, the digests sent are {checksum}"

    def verify_weights(self, expected_digests: dict[str, str], *, checksum: str = DEFAULT) -> tuple[bool, str]:
        """Ask the engine to re-hash tensors by name (SGLang's update-weights checker, hashing with the
        ``config.checksum`` its workers were started with: digests of another algorithm are refused)."""
        if checksum != self.config.checksum:
            return False, self._other_checksum(checksum)
        with self._lock:
            return self._server.verify(expected_digests)

    def update_weights_from_disk(self, path: str) -> WeightUpdateResult:
        """Reload the DiT from a pipeline directory with a ``transformer/`` folder (all-or-nothing)."""
        t0 = time.perf_counter()
        with self._lock:
            ok, message = self._server.update_from_disk(str(path))
            if ok:
                self._replay.reset_to_disk(path)
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
