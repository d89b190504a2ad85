"""The data-parallel balancer over rollout engines.

Fast tests need CPU, 1 process, no sglang: the engines are real ``DiffusersEngine`` baseline loops on a
tiny SD3 pipeline built in memory (``tools/make_tiny_pipeline.py``); tests that must hold requests in
flight wrap them in ``GatedEngine``, which waits for a test-controlled event before sampling. The
balancer's decision itself is never replaced. The one ``engine`` test starts 2 real SGLang engines
(~30 s each, marked slow).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import megaflow  # noqa: F401  (import guards before anything heavy)
from megaflow.bridge.buckets import pack
from megaflow.checksum import tensor_digest
from megaflow.rollout.balancer import Balancer
from megaflow.rollout.baseline import DiffusersEngine, DiffusersEngineConfig
from megaflow.rollout.engine import RolloutEngine
from megaflow.rollout.types import RolloutRequest

REPO = Path(__file__).resolve().parents[2]


def _tiny_tool():
    from megaflow.models import tiny_pipeline
    return tiny_pipeline


@pytest.fixture(scope="module")
def engines():
    """Three baseline engines with identical weights (separate modules, so updates are per engine)."""
    torch.set_num_threads(1)
    tool = _tiny_tool()
    out = []
    for i in range(3):
        pipe = tool.build_sd3(seed=0)
        pipe.set_progress_bar_config(disable=True)
        out.append(DiffusersEngine(pipe, config=DiffusersEngineConfig(engine_id=f"e{i}", max_sequence_length=16)))
    return out


class GatedEngine:
    """A real engine that holds each ``generate`` until ``gate`` is set (to keep requests in flight)."""

    def __init__(self, inner: DiffusersEngine):
        self.inner = inner
        self.engine_id = inner.engine_id
        self.gate = threading.Event()

    def generate(self, requests):
        assert self.gate.wait(timeout=60), "test gate never opened"
        return self.inner.generate(requests)

    def __getattr__(self, name):  # the rest of the protocol: delegate
        return getattr(self.inner, name)


def _req(i: int, k: int = 1) -> RolloutRequest:
    return RolloutRequest(prompt=f"a red circle {i}", num_outputs=k, seed=100 * i, num_steps=2,
                          height=32, width=32, request_id=f"r{i}")


def _submit(balancer: Balancer, request: RolloutRequest, results: dict) -> threading.Thread:
    """Call balancer.generate([request]) in a thread; return once the request is counted in flight."""
    before = len(balancer.assignments)
    thread = threading.Thread(target=lambda: results.__setitem__(request.request_id, balancer.generate([request])))
    thread.start()
    deadline = time.monotonic() + 30
    while len(balancer.assignments) == before:
        assert time.monotonic() < deadline, "request was never dispatched"
        time.sleep(0.005)
    return thread


def _engine_of(balancer: Balancer, request_id: str) -> str:
    return dict(balancer.assignments)[request_id]


def test_protocol_and_validation(engines):
    balancer = Balancer(engines[:2])
    assert isinstance(balancer, RolloutEngine)
    with pytest.raises(ValueError, match="unique"):
        Balancer([engines[0], engines[0]])
    with pytest.raises(ValueError, match="at least one"):
        Balancer([])


def test_choice_follows_in_flight_counts(engines):
    gated = [GatedEngine(e) for e in engines]
    balancer = Balancer(gated, seed=3)
    results: dict = {}
    threads = [_submit(balancer, _req(i), results) for i in range(3)]
    # three idle engines, three requests: each went to a different (then least-loaded) engine
    first = [_engine_of(balancer, f"r{i}") for i in range(3)]
    assert sorted(first) == ["e0", "e1", "e2"]
    assert balancer.in_flight() == [1, 1, 1]
    # let exactly one engine finish: it is now the only least-loaded one and must get the next request
    done = gated[1]
    done.gate.set()
    threads[first.index("e1")].join(timeout=60)
    assert balancer.in_flight() == [1, 0, 1]
    threads.append(_submit(balancer, _req(3), results))
    assert _engine_of(balancer, "r3") == "e1"
    # e1 is gated open, so r3 finishes; loads [1,0,1] again -> r4 to e1; then close e1 to hold r5 there
    threads[-1].join(timeout=60)
    done.gate.clear()
    threads.append(_submit(balancer, _req(4), results))
    assert _engine_of(balancer, "r4") == "e1"
    assert balancer.in_flight() == [1, 1, 1]
    for g in gated:
        g.gate.set()
    for t in threads:
        t.join(timeout=60)
    m = balancer.metrics()
    assert m["in_flight"] == 0 and m["num_requests"] == 5 and m["num_images"] == 5
    assert m["engines"]["e1"]["num_requests"] == 3
    assert all(results[f"r{i}"][0].engine_id == _engine_of(balancer, f"r{i}") for i in range(5))


def _sequential_choices(engines, seed: int, n: int = 16) -> list[str]:
    balancer = Balancer(engines, seed=seed)
    for i in range(n):  # one at a time: every choice is a tie between idle engines
        balancer.generate([_req(i)])
    return [eid for _, eid in balancer.assignments]


def test_ties_broken_randomly_and_seeded(engines):
    two = engines[:2]
    a = _sequential_choices(two, seed=0)
    assert a == _sequential_choices(two, seed=0), "same seed must give the same tie-breaks"
    assert set(a) == {"e0", "e1"}, f"ties must not always go to one engine: {a}"
    assert a != _sequential_choices(two, seed=1), "a different seed should break ties differently"


def test_group_atomic_order_and_counters(engines):
    two = engines[:2]
    requests = [_req(i, k=3) for i in range(5)]
    balancer = Balancer(two, seed=0)
    trajs = balancer.generate(requests)
    # request order, then output index; a group never splits across engines
    assert [(t.request_id, t.index) for t in trajs] == [(f"r{i}", j) for i in range(5) for j in range(3)]
    for i in range(5):
        group = {t.engine_id for t in trajs if t.request_id == f"r{i}"}
        assert group == {_engine_of(balancer, f"r{i}")}
    # all five were dispatched at once: least in-flight splits them 3/2 and both engines worked
    m = balancer.metrics()
    counts = sorted(row["num_requests"] for row in m["engines"].values())
    assert counts == [2, 3]
    assert sorted(row["max_in_flight"] for row in m["engines"].values()) == [2, 3]
    assert m["num_images"] == 15 and m["in_flight"] == 0
    assert all(row["busy_seconds"] > 0 for row in m["engines"].values())
    # same samples as asking one engine directly (per-sample seeds; batching changes only rounding)
    direct = two[0].generate(requests)
    for got, ref in zip(trajs, direct):
        assert got.seed == ref.seed
        torch.testing.assert_close(got.latents, ref.latents, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.log_probs, ref.log_probs, atol=1e-4, rtol=1e-4)


def test_in_flight_cap_sends_work_to_the_free_engine(engines):
    slow, fast = GatedEngine(engines[0]), engines[1]
    balancer = Balancer([slow, fast], seed=0, max_in_flight_per_engine=1)
    out: dict = {}
    caller = threading.Thread(target=lambda: out.setdefault("t", balancer.generate([_req(i) for i in range(4)])))
    caller.start()
    deadline = time.monotonic() + 60
    while balancer.metrics()["engines"]["e1"]["num_requests"] < 3:  # the free engine takes every other group
        assert time.monotonic() < deadline, f"stuck: {balancer.metrics()}"
        time.sleep(0.01)
    slow.gate.set()
    caller.join(timeout=60)
    m = balancer.metrics()["engines"]
    assert (m["e0"]["num_requests"], m["e1"]["num_requests"]) == (1, 3)
    assert m["e0"]["max_in_flight"] == 1 and m["e1"]["max_in_flight"] == 1
    assert [t.request_id for t in out["t"]] == [f"r{i}" for i in range(4)]


def test_control_fan_out_and_checksum_agreement(engines):
    balancer = Balancer(engines, seed=0)
    before = balancer.checksum()
    name = "transformer_blocks.0.attn.to_q.weight"
    orig = engines[0].transformer.state_dict()[name].clone()
    new = orig + 0.01
    try:
        result = balancer.update_weights(iter([(name, new)]))  # an iterator: every engine must still get it
        assert result.ok and result.num_tensors == 1, result
        after = balancer.checksum()
        assert after != before and {e.checksum() for e in engines} == {after}
        bad = balancer.update_weights([("no.such.weight", new)])
        assert not bad.ok and "e0" in bad.message and balancer.checksum() == after
        # a replica that drifted is caught
        engines[2].update_weights([(name, new + 0.01)])
        with pytest.raises(RuntimeError, match="disagree"):
            balancer.checksum()
        # bridge path: one bucket to every engine, then every engine re-hashes what it holds
        assert balancer.load_bucket(pack([(name, new)])).ok
        assert balancer.checksum() == after
        assert balancer.verify_weights({name: tensor_digest(new, "xxh3")}, checksum="xxh3")[0]
        engines[1].update_weights([(name, orig)])
        ok, msg = balancer.verify_weights({name: tensor_digest(new, "xxh3")}, checksum="xxh3")
        assert not ok and "e1" in msg and "e0" not in msg
        health = balancer.health()
        assert health.alive and "e2" in health.detail
    finally:  # the engines are shared with other tests
        assert balancer.update_weights([(name, orig)]).ok
    assert balancer.checksum() == before


def test_engine_error_reaches_caller_and_counters_recover(engines):
    tool_engine = DiffusersEngine(engines[0].pipe, config=DiffusersEngineConfig(engine_id="dead"))
    tool_engine.shutdown()
    balancer = Balancer([tool_engine], seed=0)
    with pytest.raises(RuntimeError, match="shut down"):
        balancer.generate([_req(0), _req(1)])
    m = balancer.metrics()["engines"]["dead"]
    assert m["in_flight"] == 0 and m["num_errors"] == 2
    assert not balancer.health().alive


@pytest.mark.slow
@pytest.mark.engine
def test_two_sglang_engines_share_eight_groups(tmp_path):
    """2 real SGLang engines, 8 groups in one call: split 4/4 by in-flight counts, both engines busy."""
    from megaflow.rollout.sglang import SGLangEngine, SGLangEngineConfig

    pipeline_dir = str(_tiny_tool().make_tiny_pipeline("sd3", tmp_path / "tiny-sd3", seed=0))
    # Started in this thread: SGLang workers die with the thread that spawned them (PR_SET_PDEATHSIG).
    # sleep_on_idle: an idle SGLang scheduler otherwise busy-polls a core.
    engines = [SGLangEngine(SGLangEngineConfig(model_path=pipeline_dir, engine_id=f"s{i}",
                                               server_kwargs={"sleep_on_idle": True})) for i in range(2)]
    try:
        balancer = Balancer(engines, seed=0)
        requests = [_req(i, k=2) for i in range(8)]
        trajs = balancer.generate(requests)
        assert [(t.request_id, t.index) for t in trajs] == [(f"r{i}", j) for i in range(8) for j in range(2)]
        m = balancer.metrics()["engines"]
        assert sorted(row["num_requests"] for row in m.values()) == [4, 4]
        assert all(row["max_in_flight"] == 4 and row["busy_seconds"] > 0 for row in m.values())
        for i in range(8):
            assert {t.engine_id for t in trajs if t.request_id == f"r{i}"} == {_engine_of(balancer, f"r{i}")}
        assert torch.isfinite(torch.stack([t.log_probs for t in trajs])).all()
        balancer.checksum()  # both engines hold the same weights
    finally:
        for e in engines:
            e.shutdown()
