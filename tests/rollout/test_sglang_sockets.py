"""megaflow's SGLang plugin keeps a single-node engine's sockets private (megaflow.rollout.sglang.plugin), checked
without an engine against SGLang's own functions: the rendezvous of SGLang's ``init_distributed_environment`` (a
TCP store on every interface) becomes a file in the engine's directory, and the scheduler's loopback ZMQ endpoint
an ipc socket there; multi-node addresses and processes without a directory are left alone. A live engine's
sockets are listed in test_sglang_engine.py."""
import inspect
import os

import pytest

import megaflow  # noqa: F401  (import guards before sglang/megatron)
from megaflow.rollout.sglang import plugin


@pytest.fixture
def recorded():
    """A stand-in with the signature of SGLang's ``init_distributed_environment`` that records its arguments."""
    from sglang.multimodal_gen.runtime.distributed.parallel_state import init_distributed_environment

    calls = []

    def original(*args, **kwargs):
        calls.append(inspect.signature(init_distributed_environment).bind(*args, **kwargs).arguments)

    original.__signature__ = inspect.signature(init_distributed_environment)
    return original, calls


def test_loopback_rendezvous_becomes_a_file_in_the_engines_directory(recorded, monkeypatch, tmp_path):
    original, calls = recorded
    monkeypatch.setenv(plugin.SOCKET_DIR_VAR, str(tmp_path))
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    plugin.private_rendezvous(original, world_size=2, rank=1, distributed_init_method="tcp://127.0.0.1:29500",
                              local_rank=1)
    assert calls[-1]["distributed_init_method"] == f"file://{tmp_path}/rendezvous"
    assert (calls[-1]["world_size"], calls[-1]["rank"], calls[-1]["local_rank"]) == (2, 1, 1)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_multi_node_and_foreign_rendezvous_are_left_alone(recorded, monkeypatch, tmp_path):
    original, calls = recorded
    monkeypatch.setenv(plugin.SOCKET_DIR_VAR, str(tmp_path))
    plugin.private_rendezvous(original, 4, 0, "tcp://10.0.0.7:29500")
    assert calls[-1]["distributed_init_method"] == "tcp://10.0.0.7:29500"
    monkeypatch.delenv(plugin.SOCKET_DIR_VAR)
    plugin.private_rendezvous(original, 1, 0, "tcp://127.0.0.1:29500")
    assert calls[-1]["distributed_init_method"] == "tcp://127.0.0.1:29500"


def test_scheduler_endpoint_moves_to_the_owning_engines_directory(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from sglang.multimodal_gen.runtime.server_args import ServerArgs

    monkeypatch.delenv(plugin.SOCKET_DIR_VAR, raising=False)
    unhooked = ServerArgs.scheduler_endpoint_for
    mine = SimpleNamespace(host=None, scheduler_ports=None, scheduler_port=41001)
    other = SimpleNamespace(host=None, scheduler_ports=None, scheduler_port=41002)
    remote = SimpleNamespace(host="10.0.0.7", scheduler_ports=None, scheduler_port=41001)
    plugin.own_sockets(41001, str(tmp_path))
    try:
        assert plugin.private_scheduler_endpoint(unhooked, mine, 1) == f"ipc://{tmp_path}/scheduler-1"
        assert plugin.private_scheduler_endpoint(unhooked, other, 0) == "tcp://127.0.0.1:41002"
        assert plugin.private_scheduler_endpoint(unhooked, remote, 0) == "tcp://10.0.0.7:41001"
    finally:
        plugin.disown_sockets(41001)
    assert plugin.private_scheduler_endpoint(unhooked, mine, 0) == "tcp://127.0.0.1:41001"
