"""Warm engine workers (megaflow.rollout.sglang.warm): a worker spawned before its engine's server args exist
becomes that engine's worker -- the same samples, bit for bit, as an engine started cold on the same pipeline,
its output in the engine's log file, its socket directory removed with the engine -- and a worker no engine
takes, or one that died before its server args came, leaves no process and no directory behind.
Needs: engine (two real engines at once, ~1 min)."""
from __future__ import annotations

import os
import signal

import pytest
import torch

import megaflow  # noqa: F401  (import guards before sglang/megatron)
from megaflow.checksum import DEFAULT
from megaflow.rollout.sglang.warm import WarmWorker
from megaflow.rollout.types import RolloutRequest

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _warm(log_file=None) -> WarmWorker:
    return WarmWorker.start(log_file=log_file, device_index=None, num_threads=1, checksum=DEFAULT)


def test_a_warm_engine_samples_what_a_cold_one_does(tiny_sd3_dir, tmp_path):
    from megaflow.rollout.sglang import SGLangEngine, SGLangEngineConfig, worker_processes_alive

    torch.set_num_threads(1)
    warm = _warm(tmp_path / "logs" / "warm.log")  # as megaflow.run.build.start_engine_workers names it
    engines = []
    try:
        engines.append(SGLangEngine(SGLangEngineConfig(model_path=str(tiny_sd3_dir), num_threads=1,
                                                       engine_id="cold")))
        engines.append(SGLangEngine(SGLangEngineConfig(model_path=str(tiny_sd3_dir), num_threads=1,
                                                       engine_id="warm", log_dir=str(tmp_path / "logs")), warm=warm))
        cold, hot = engines
        assert hot.health().worker_pids == [warm.process.pid] and hot._server.socket_dir == warm.socket_dir
        requests = [RolloutRequest(prompt="a red cat", num_outputs=3, seed=5, num_steps=4, request_id="g0"),
                    RolloutRequest(prompt="a blue dog", num_outputs=2, seeds=[40, 7], num_steps=4, request_id="g1")]
        expected, got = cold.generate(requests), hot.generate(requests)
        assert len(got) == len(expected) == 5
        for a, b in zip(expected, got):
            assert a.seed == b.seed and torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
            assert torch.equal(a.image, b.image)
        assert "checkpoint shards" in (tmp_path / "logs" / "warm.log").read_text()  # the worker loading the DiT
    finally:
        for engine in engines:
            engine.shutdown()
        warm.discard()  # a no-op for a worker its engine took and stopped
    assert worker_processes_alive([warm.process.pid]) == [] and not os.path.exists(warm.socket_dir)


def test_a_warm_worker_no_engine_takes_or_that_died_leaves_nothing(tiny_sd3_dir):
    from megaflow.rollout.sglang import SGLangEngine, SGLangEngineConfig

    unused, dead = _warm(), _warm()
    unused.discard()
    assert not unused.process.is_alive() and not os.path.exists(unused.socket_dir)
    os.kill(dead.process.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="exited during initialization"):
        SGLangEngine(SGLangEngineConfig(model_path=str(tiny_sd3_dir), num_threads=1), warm=dead)
    assert not dead.process.is_alive() and not os.path.exists(dead.socket_dir)
