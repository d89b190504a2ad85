"""The SGLang adapter: the only package importing sglang. Design notes: docs/design/rollout.md."""
import importlib

_HOMES = {"SGLangEngineConfig": "config", "EngineCrashed": "engine",
          "SGLangEngine": "engine", "free_port": "server", "weights_checksum": "server",
          "worker_processes_alive": "server", "EngineCallFailed": "wire"}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
