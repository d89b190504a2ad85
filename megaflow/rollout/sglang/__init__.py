"""The SGLang adapter: the only package importing sglang (``megaflow.rollout`` itself does not).

- ``engine``: ``SGLangEngine`` (request merging and dispatch, crash supervision, weights, lifecycle);
- ``server``: SGLang's worker processes (start, control requests, stop) and where their output goes;
- ``wire``: ``RolloutRequest`` -> SGLang request and SGLang's answer -> ``Trajectory``;
- ``config``: ``SGLangEngineConfig`` and ``engine_config`` (its one mapping from megaflow's config).
"""
from megaflow.rollout.sglang.config import FAMILY_MODEL_IDS, SGLangEngineConfig
from megaflow.rollout.sglang.engine import EngineCrashed, SGLangEngine
from megaflow.rollout.sglang.server import free_port, weights_checksum, worker_processes_alive
from megaflow.rollout.sglang.wire import EngineCallFailed

__all__ = ["FAMILY_MODEL_IDS", "EngineCallFailed", "EngineCrashed", "SGLangEngine", "SGLangEngineConfig",
           "free_port", "weights_checksum", "worker_processes_alive"]
