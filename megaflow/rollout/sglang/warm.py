"""Warm engine workers: a one-rank engine's worker process started before its server args exist.

Invariant: it runs SGLang's ``bootstrap_scheduler_process`` steps in their order and answers as ``launch_server``'s
workers do; from the server args on it is that worker. Imports no sglang in the host.
Design notes: docs/design/rollout.md.
"""
from __future__ import annotations

import multiprocessing as mp
import shutil
import tempfile
from multiprocessing.connection import Connection, wait
from pathlib import Path

from megaflow.rollout.sglang.spawning import spawn_settings

WORKER_NAME = "sglang-diffusionWorker-0"  # launch_server's name for a one-rank engine's worker


class WarmWorker:
    """One spawned worker waiting for its server args (:meth:`start`), used once by ``EngineServer.start`` or
    stopped by :meth:`discard`."""

    def __init__(self, process, socket_dir: str, args: Connection, ready: Connection):
        self.process, self.socket_dir = process, socket_dir
        """The worker and its engine's private socket directory (named to it when spawned; the engine's from
        then on: ``EngineServer.stop`` removes it)."""
        self._args, self._ready = args, ready  # the server args go out on one pipe, the ready message comes back

    @classmethod
    def start(cls, *, log_file: Path | None, device_index: int | None, num_threads: int | None,
              checksum: str) -> WarmWorker:
        """Spawn the worker now, with what ``EngineServer.start`` would spawn it with (same arguments)."""
        ctx = mp.get_context("spawn")
        socket_dir = tempfile.mkdtemp(prefix="megaflow-engine-")  # 0700, as EngineServer.start makes it
        args_in, args_out = ctx.Pipe(duplex=False)
        ready_in, ready_out = ctx.Pipe(duplex=False)
        try:
            with spawn_settings(log_file=log_file, device_index=device_index, num_threads=num_threads,
                                checksum=checksum, socket_dir=socket_dir):
                process = ctx.Process(target=_worker_main, args=(args_in, ready_out), name=WORKER_NAME, daemon=True)
                process.start()
        except BaseException:
            for end in (args_out, ready_in):
                end.close()
            shutil.rmtree(socket_dir, ignore_errors=True)
            raise
        finally:
            args_in.close()
            ready_out.close()
        return cls(process, socket_dir, args_out, ready_in)

    def launch(self, server_args) -> list:
        """Hand the worker its engine's ``server_args`` (built as for ``launch_server``, with this worker's
        socket directory) and wait until it is ready; its process in a list, as ``launch_server`` returns them.
        A worker that exits or fails first is stopped and the error raised."""
        from sglang.multimodal_gen.runtime.managers.worker_bootstrap import ServerArgsPayload
        from sglang.multimodal_gen.runtime.utils.logging_utils import configure_logger

        configure_logger(server_args)  # this process's sglang logging, as launch_server sets it
        try:
            self._args.send(ServerArgsPayload.capture(server_args))
            self._args.close()
            if self.process.sentinel in wait([self._ready, self.process.sentinel]):  # launch_server's order
                self.process.join()
                raise RuntimeError(f"{WORKER_NAME} exited during initialization (exit code "
                                   f"{self.process.exitcode}). Check the worker logs.")
            try:
                data = self._ready.recv()
            except EOFError as e:
                raise RuntimeError(f"{WORKER_NAME} closed its startup pipe before ready. Check the worker "
                                   "logs.") from e
            if data.get("status") != "ready":
                raise RuntimeError(f"{WORKER_NAME} failed to initialize: {data}")
        except BaseException:
            self._stop()
            raise
        finally:
            self._ready.close()
        return [self.process]

    def discard(self) -> None:
        """Stop a worker no engine will use, and remove its socket directory."""
        self._stop()
        shutil.rmtree(self.socket_dir, ignore_errors=True)

    def _stop(self) -> None:
        for end in (self._args, self._ready):
            end.close()  # the worker's end of file: it leaves while it waits for its server args
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)


def _worker_main(args: Connection, ready: Connection) -> None:
    """The worker: SGLang's ``bootstrap_scheduler_process`` with the runtime imported before the server args
    arrive on ``args`` (the host's end closing first: leave); ``ready`` is its startup pipe."""
    from sglang.multimodal_gen.runtime.utils.process import defer_full_gc_for_imports, kill_itself_when_parent_died

    kill_itself_when_parent_died()
    with defer_full_gc_for_imports():
        from sglang.multimodal_gen.runtime.platforms import initialize_current_platform

        initialize_current_platform()
        from sglang.multimodal_gen.runtime.platforms.plugins import apply_plugin_hooks, load_plugins

        load_plugins()
        apply_plugin_hooks()
        import sglang.multimodal_gen.runtime.server_args  # noqa: F401  (what unpickling the server args imports)
        from sglang.multimodal_gen.runtime.managers import gpu_worker
    try:
        payload = args.recv()
    except EOFError:
        return
    finally:
        args.close()
    with defer_full_gc_for_imports():
        server_args = payload.materialize()
    gpu_worker.run_scheduler_process(local_rank=0, rank=0, server_args=server_args, pipe_writer=ready)
