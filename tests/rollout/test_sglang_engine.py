"""The embedded SGLang engine on CPU (needs: engine; one real engine shared by the module, ~1-2 min).

One engine is started from the session's tiny SD3 pipeline and shared by every test here, in file
order; the crash test restarts it and the last test shuts it down. Checks: trajectory layout, log-prob
recomputation with megaflow's flow math (1e-6), parity with the reference sampler (1e-5), weight update by
tensors and from disk (checksums verified, images change and come back), release/resume on CPU, the sockets
(listeners on loopback only, the scheduler on an ipc path in a 0700 directory), a worker killed mid-run (restart +
retry, logged), and shutdown stopping exactly our worker processes (and removing that directory).
"""
from __future__ import annotations

import logging
import os
import signal
import stat
import threading
import time

import psutil
import pytest
import torch

import megaflow  # noqa: F401  (import guards before sglang/megatron)
from megaflow.flow.step import config_for_step, sigma_max_of, transition_log_prob
from megaflow.testing.reference import ReferenceSampler, sde_step_indices, transition_config
from megaflow.rollout.types import RolloutRequest
from megaflow.testing import sockets
import megaflow.rollout.sglang as sglang_engine

pytestmark = [pytest.mark.engine, pytest.mark.slow]

STEPS = 4


@pytest.fixture(scope="module")
def engine(tiny_sd3_dir):
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as env:  # the config's num_threads must win over the inherited variable
        env.setenv("OMP_NUM_THREADS", "2")
        eng = sglang_engine.SGLangEngine(sglang_engine.SGLangEngineConfig(model_path=str(tiny_sd3_dir),
                                                                          num_threads=1))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_sd3_dir):
    return ReferenceSampler(tiny_sd3_dir)


def _requests(**kw):
    return [RolloutRequest(prompt="a red cat", num_outputs=3, seed=5, num_steps=STEPS, request_id="g0", **kw),
            RolloutRequest(prompt="a blue dog", num_outputs=2, seeds=[40, 7], num_steps=STEPS, request_id="g1", **kw)]


def _recompute_log_probs(t):
    """log p(x_{t+1} | x_t) of every step from the trajectory and the engine's velocities."""
    config, window = transition_config(t), sde_step_indices(t)
    out = []
    for i in range(t.num_steps):
        res = transition_log_prob(t.latents[i:i + 1], t.model_outputs[i:i + 1], t.latents[i + 1:i + 2],
                                  t.sigmas[i], t.sigmas[i + 1], sigma_max=sigma_max_of(t.sigmas),
                                  config=config_for_step(config, i, window))
        out.append(res.log_prob[0])
    return torch.stack(out)


def _thread_cpu_seconds(engine) -> dict[tuple[int, int], float]:
    procs = [psutil.Process(pid) for pid in engine.health().worker_pids]
    return {(p.pid, t.id): t.user_time + t.system_time for p in procs for t in p.threads()}


def test_worker_threads_env_is_set_while_spawning_and_restored(monkeypatch):
    from megaflow.rollout.sglang.spawning import _worker_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    with _worker_threads(3):
        assert os.environ["OMP_NUM_THREADS"] == "3"
    assert os.environ["OMP_NUM_THREADS"] == "7"
    monkeypatch.delenv("OMP_NUM_THREADS")
    with _worker_threads(2):
        assert os.environ["OMP_NUM_THREADS"] == "2"
    assert "OMP_NUM_THREADS" not in os.environ
    with _worker_threads(None):
        assert "OMP_NUM_THREADS" not in os.environ
    with pytest.raises(ValueError, match="num_threads"):
        sglang_engine.SGLangEngineConfig(model_path="x", num_threads=0)


def test_workers_compute_on_the_configured_threads(engine):
    """``num_threads=1`` reaches the workers (started under OMP_NUM_THREADS=2, see the fixture): one thread
    does all the compute of a call (with 2 intra-op threads a second one takes about half; the workers' own
    environment cannot be read back: SGLang's process title overwrites it). This process's OMP_NUM_THREADS is
    left as it was."""
    before = _thread_cpu_seconds(engine)
    engine.generate([RolloutRequest(prompt="a red cat", num_outputs=8, seed=1, num_steps=8)])
    used = sorted(t - before.get(k, 0.0) for k, t in _thread_cpu_seconds(engine).items())
    assert used[-1] > 0 and used[-2] < 0.2 * used[-1], f"per-thread CPU seconds of the call: {used[-4:]}"
    assert os.environ.get("OMP_NUM_THREADS") != "2"


def test_trajectory_layout(engine):
    trajs = engine.generate(_requests())
    assert [(t.request_id, t.index, t.seed) for t in trajs] == [
        ("g0", 0, 5), ("g0", 1, 6), ("g0", 2, 7), ("g1", 0, 40), ("g1", 1, 7)]
    for t in trajs:
        assert t.latents.shape == (STEPS + 1, 16, 8, 8) and t.model_outputs is None  # velocities only on request
        assert t.log_probs.shape == (STEPS,) and torch.isfinite(t.log_probs).all()
        assert t.sigmas[0] == 1.0 and t.sigmas[-1] == 0.0 and (t.sigmas.diff() < 0).all()
        assert t.image.shape == (3, 64, 64) and 0.0 <= t.image.min() and t.image.max() <= 1.0
        assert t.conditioning["encoder_hidden_states"].dim() == 2 and t.engine_id == engine.engine_id
        assert t.timings["batch_size"] == 5.0  # the two CFG-free groups ran as one batch
    # distinct seeds give distinct samples; the two prompts give distinct conditioning
    assert not torch.equal(trajs[0].latents[0], trajs[1].latents[0])
    assert not torch.equal(trajs[0].conditioning["encoder_hidden_states"],
                           trajs[3].conditioning["encoder_hidden_states"])


@pytest.mark.parametrize("kw", [
    dict(sde_type="sde"),
    dict(sde_type="sde", sde_step_indices=[1, 2]),
    dict(sde_type="cps", noise_level=0.8, log_prob_no_const=True),
    dict(sde_type="ode"),
    dict(sde_type="sde", do_cfg=True, guidance_scale=4.5),
], ids=["sde", "sde-window", "cps-noconst", "ode", "sde-cfg"])
def test_log_probs_recompute_with_flow_math(engine, kw):
    trajs = engine.generate(_requests(return_model_outputs=True, **kw))
    assert all(t.model_outputs.shape == (STEPS, 16, 8, 8) for t in trajs)
    for t in trajs:
        torch.testing.assert_close(_recompute_log_probs(t), t.log_probs, atol=1e-6, rtol=0)
        assert (t.log_probs[~t.sde_mask] == 0).all()
        if kw["sde_type"] == "ode":  # deterministic Euler steps
            torch.testing.assert_close(t.latents[1:], t.latents[:-1] + t.sigmas.diff().view(-1, 1, 1, 1)
                                       * t.model_outputs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kw", [dict(), dict(sde_step_indices=[0, 2]), dict(do_cfg=True, guidance_scale=4.5)],
                         ids=["sde", "window", "cfg"])
def test_reference_sampler_parity(engine, reference, kw):
    trajs = engine.generate(_requests(return_model_outputs=True, **kw))
    for group in (trajs[:3], trajs[3:]):
        ref = reference.replay(group)
        torch.testing.assert_close(ref.latents, torch.stack([t.latents for t in group]), atol=1e-5, rtol=0)
        torch.testing.assert_close(ref.log_probs, torch.stack([t.log_probs for t in group]), atol=1e-5, rtol=0)
        torch.testing.assert_close(ref.model_outputs, torch.stack([t.model_outputs for t in group]),
                                   atol=1e-5, rtol=0)


def test_conditioning_matches_diffusers_encode_prompt(engine, reference):
    (t,) = engine.generate([RolloutRequest(prompt="a big house", num_steps=2, do_cfg=True, guidance_scale=3.0,
                                           negative_prompt="blue")])
    expected = reference.encode_prompt("a big house", negative_prompt="blue", do_cfg=True)
    assert set(expected) <= set(t.conditioning)
    for name, value in expected.items():
        torch.testing.assert_close(t.conditioning[name], value, atol=1e-5, rtol=0)


def test_weight_update_changes_images_and_verifies(engine, reference, tiny_sd3_dir):
    req = [RolloutRequest(prompt="a red cat", num_outputs=2, seed=3, num_steps=STEPS, return_model_outputs=True)]
    before, checksum0 = engine.generate(req), engine.checksum()
    gen = torch.Generator().manual_seed(0)
    state = {n: p + 0.05 * torch.randn(p.shape, generator=gen) for n, p in reference.transformer.state_dict().items()}

    result = engine.update_weights(state.items())
    assert result.ok, result.message
    assert result.num_tensors == len(state) and result.num_bytes > 0
    assert engine.checksum() == sglang_engine.weights_checksum(state.items()) != checksum0
    after = engine.generate(req)
    assert (after[0].image - before[0].image).abs().max() > 1e-3
    # log-probs of its own sample depend only on the noise, not the weights
    torch.testing.assert_close(after[0].log_probs, before[0].log_probs, atol=1e-6, rtol=0)
    updated = ReferenceSampler(tiny_sd3_dir)
    updated.load_state_dict(state)
    torch.testing.assert_close(updated.replay(after).latents, torch.stack([t.latents for t in after]),
                               atol=1e-5, rtol=0)

    bad = engine.update_weights([("no_such.weight", torch.zeros(2))])
    assert not bad.ok  # SGLang skips unknown names with success=True; the SHA-256 check catches it

    restored = engine.update_weights_from_disk(str(tiny_sd3_dir))
    assert restored.ok, restored.message
    assert engine.checksum() == checksum0
    assert torch.equal(engine.generate(req)[0].image, before[0].image)


def test_bridge_verify_flag_hashes_once_or_never(engine, reference, monkeypatch, tiny_sd3_dir):
    """bridge.verify = false: no hashing anywhere in the sync (an unknown name then goes unnoticed, as
    SGLang skips it); true: each tensor hashed once on the sending side, and the single-rank engine checks each
    bucket in its load request (no separate check request)."""
    import megaflow.bridge.buckets as buckets
    from megaflow.bridge import SyncError
    from megaflow.bridge.shared_memory import SharedMemoryBridge
    from megaflow.rollout.sglang import engine as engine_module
    calls, checks = [], []
    real_bucket, real_tensor = buckets.Bucket.digests, engine_module.tensor_digest
    monkeypatch.setattr(buckets.Bucket, "digests", lambda b, c: calls.extend(b.metadata) or real_bucket(b, c))
    monkeypatch.setattr(engine_module, "tensor_digest", lambda t, c: calls.append(1) or real_tensor(t, c))
    real_verify = engine._server.verify
    monkeypatch.setattr(engine._server, "verify", lambda d: checks.append(d) or real_verify(d))
    state = list(reference.transformer.state_dict().items())  # the weights the engine holds already
    checksum0 = engine.checksum()
    assert not SharedMemoryBridge([engine], bucket_bytes=64 << 10, verify=False).push(state).verified
    assert calls == []
    assert SharedMemoryBridge([engine], bucket_bytes=64 << 10, verify=True).push(state).verified
    assert len(calls) == len(state) and checks == []
    unknown = [("no_such.weight", torch.zeros(2))]
    SharedMemoryBridge([engine], verify=False).push(unknown)
    with pytest.raises(SyncError, match="not verified after update.*missing 1 tensor"):
        SharedMemoryBridge([engine], verify=True).push(unknown)
    assert checks == []
    assert engine.checksum() == checksum0
    # the engine replays what it was sent after a worker restart: leave it holding the pipeline's weights only
    assert engine.update_weights_from_disk(str(tiny_sd3_dir)).ok


@pytest.mark.parametrize("damage", ["flip", "partial"])
def test_engine_refuses_a_bucket_damaged_after_it_was_hashed(engine, reference, tiny_sd3_dir, damage):
    """The worker checks a load against the sender's digests: one byte flipped, or the bucket's second half
    lost, between hashing and loading fails the load, naming a damaged tensor; the intact bucket loads."""
    from megaflow.bridge.buckets import Bucket, pack
    state = list(reference.transformer.state_dict().items())
    bucket = pack(state, shared=True)
    digests = bucket.digests("xxh3")
    flat = bucket.flat.clone().share_memory_()
    if damage == "flip":
        flat[flat.numel() // 2] ^= 0x01
    else:
        flat[flat.numel() // 2:] = 0
    try:
        result = engine.load_bucket(Bucket(flat=flat, metadata=bucket.metadata), digests=digests)
        assert not result.ok and "differ from what was sent" in result.message, result.message
        ok = engine.load_bucket(bucket, digests=digests)
        assert ok.ok and "Verified" in ok.message, ok.message
        assert not engine.load_bucket(bucket, digests=digests, checksum="sha256").ok  # not the engine's hash
    finally:
        assert engine.update_weights_from_disk(str(tiny_sd3_dir)).ok


def test_shared_memory_sync_is_bit_exact_and_fast(engine, reference, tiny_sd3_dir):
    """A verified shared-memory sync leaves the engine holding exactly the bytes sent (SGLang's own checksum of
    the sent tensors, computed here), in well under 0.3 s for the 1.2 MB tiny DiT (0.6 s before the
    plugin froze the workers' heaps: SGLang's per-update gc.collect), also when a later sync only names the
    staging slot the worker keeps mapped."""
    from megaflow.bridge.shared_memory import SharedMemoryBridge
    gen = torch.Generator().manual_seed(1)
    state = {n: p + 0.01 * torch.randn(p.shape, generator=gen) for n, p in reference.transformer.state_dict().items()}
    bridge = SharedMemoryBridge([engine], verify=True)
    seconds = []
    for _ in range(3):
        t0 = time.perf_counter()
        report = bridge.push(state.items())
        seconds.append(time.perf_counter() - t0)
        assert report.verified and report.num_tensors == len(state), report
    assert engine.checksum() == sglang_engine.weights_checksum(state.items())
    assert sorted(seconds)[1] < 0.3, seconds
    # later syncs name the staging slot the worker keeps instead of sending its memory again, and read the
    # slot's new bytes through the kept mapping
    kept = dict(engine._server._kept_slots)
    assert kept and all(t.is_shared() for t in kept.values())
    newer = {n: t + 0.01 for n, t in state.items()}
    assert bridge.push(newer.items()).verified
    assert engine.checksum() == sglang_engine.weights_checksum(newer.items())
    assert all(engine._server._kept_slots[k] is t for k, t in kept.items())
    assert engine.update_weights_from_disk(str(tiny_sd3_dir)).ok  # back to the pipeline's weights


def test_engine_listens_only_on_loopback_and_its_private_directory(engine):
    """No engine process listens beyond loopback (SGLang's TCP store listened on every interface before megaflow's
    plugin moved the rendezvous to a file), and the scheduler's ZMQ socket, which unpickles what it receives, is an
    ipc socket in a 0700 directory of ours rather than a 127.0.0.1 port any local user can reach."""
    server = engine._server
    procs = [p for pid in server.pids for p in sockets.tree(pid)]
    listening = sockets.inet_listeners(procs)
    assert listening and all(sockets.is_loopback(ip) for _, ip, _ in listening), listening
    info = os.stat(server.socket_dir)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    endpoints = server.server_args.scheduler_endpoints
    assert endpoints and all(e.startswith(f"ipc://{server.socket_dir}/") for e in endpoints), endpoints
    bound = {c.laddr for p in procs for c in p.net_connections(kind="unix") if c.laddr}
    assert {e.removeprefix("ipc://") for e in endpoints} <= bound, bound
    print("listening:", sorted({f"{ip}:{port}" for _, ip, port in listening}), "ipc:", endpoints)


def test_release_resume_on_cpu(engine):
    engine.release()  # CPU: documented no-op, but generate must refuse until resume
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(_requests())
    engine.resume()
    assert len(engine.generate(_requests()[:1])) == 3


def test_worker_killed_mid_run_is_restarted_and_retried(engine, caplog):
    requests = [RolloutRequest(prompt=f"shape {i}", num_outputs=4, seed=i, num_steps=40) for i in range(4)]
    expected = engine.generate(requests)
    old_pids = engine.health().worker_pids
    caplog.set_level(logging.WARNING, logger="megaflow.rollout.sglang")

    killer = threading.Timer(0.3, os.kill, args=(old_pids[0], signal.SIGKILL))
    killer.start()
    t0 = time.perf_counter()
    got = engine.generate(requests)
    killer.join()
    health = engine.health()
    assert health.alive and health.num_restarts == 1
    assert set(health.worker_pids).isdisjoint(old_pids)
    assert sglang_engine.worker_processes_alive(old_pids) == []
    assert any("retrying once" in r.getMessage() for r in caplog.records), "the kill did not hit a running call"
    assert any("restarted in" in r.getMessage() for r in caplog.records)
    # the retried call reproduces the pre-crash samples (same batch, same weights)
    for a, b in zip(got, expected):
        assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    print(f"crash + restart + retry took {time.perf_counter() - t0:.1f} s")


def test_shutdown_stops_exactly_our_workers(engine):
    pids, socket_dir = engine.health().worker_pids, engine._server.socket_dir
    assert sglang_engine.worker_processes_alive(pids) == pids
    engine.shutdown()
    assert sglang_engine.worker_processes_alive(pids) == []
    assert not os.path.exists(socket_dir)
    assert not engine.health().alive
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(_requests())
    engine.shutdown()  # idempotent
