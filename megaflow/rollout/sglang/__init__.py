"""The SGLang adapter: the only package importing sglang (``megaflow.rollout`` itself does not).

- ``engine``: ``SGLangEngine`` (request merging and dispatch, crash supervision, weights, lifecycle);
- ``server``: SGLang's worker processes (start, control requests, stop) and where their output goes;
- ``warm``: a worker started before its engine is configured, importing SGLang while the run builds the rest;
- ``spawning``: the environment and output workers are spawned with;
- ``wire``: ``RolloutRequest`` -> SGLang request and SGLang's answer -> ``Trajectory``;
- ``config``: ``SGLangEngineConfig`` and ``engine_config`` (its one mapping from megaflow's config).

The names below are imported when first used, so importing a module that needs no sglang (``warm``,
``spawning``, ``config``, the workers' ``plugin``) imports none.
"""
import importlib

_HOMES = {"FAMILY_MODEL_IDS": "config", "SGLangEngineConfig": "config", "EngineCrashed": "engine",
          "SGLangEngine": "engine", "free_port": "server", "weights_checksum": "server",
          "worker_processes_alive": "server", "EngineCallFailed": "wire"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
