"""Process-wide import guards, applied on ``import megaflow`` (cheap: no torch import; no environment variable set).

flash_mla (pulled in by sglang's install) ships a CUDA extension whose import raises ``OSError``
when libcuda is absent. megatron-core probes it with ``try: import flash_mla except ImportError``,
so the OSError escapes and breaks ``import megatron.core.models``. On machines without libcuda we
make ``flash_mla`` unimportable (ImportError), which is exactly what megatron expects for "not
installed". On GPU machines nothing is changed.

In SGLang engine worker processes (``ENGINE_WORKER_VAR`` set by megaflow when it spawns them) megatron is made
unimportable too: the engine never uses it, but SGLang's debug dumper imports it when installed (~3 s of every
engine start).

Engine workers also ignore SIGINT: a terminal's Ctrl-C reaches the whole process group, and the driver decides
(it stops the run after the current iteration, then stops the workers); the ignored disposition is inherited by
the processes a worker starts.

``importlib.metadata.packages_distributions()`` walks every installed distribution's file list (~0.8 s here);
diffusers and transformers each call it at import. It is memoized per sys.path (installed packages do not
change under a running process), which halves that cost in every trainer, engine and test process.
"""
from __future__ import annotations

import ctypes.util
import functools
import importlib.abc
import importlib.metadata
import os
import signal
import sys
import threading

_BLOCKED_WITHOUT_LIBCUDA = ("flash_mla",)
_BLOCKED_IN_ENGINE_WORKERS = ("megatron",)
ENGINE_WORKER_VAR = "MEGAFLOW_ENGINE_WORKER"
"""Set to "1" in the environment of the SGLang worker processes megaflow spawns (and only there)."""


class _BlockFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder that raises ImportError for a fixed set of top-level modules, each with its reason."""

    def __init__(self, reasons: dict[str, str]):
        self.reasons = reasons

    def find_spec(self, fullname, path=None, target=None):  # noqa: D401 - importlib API
        reason = self.reasons.get(fullname.split(".")[0])
        if reason is not None:
            raise ImportError(f"{fullname} disabled by megaflow: {reason}")
        return None


def has_libcuda() -> bool:
    """True when the CUDA driver library can be found (a GPU machine)."""
    return ctypes.util.find_library("cuda") is not None


def memoize_package_index() -> None:
    """Make ``importlib.metadata.packages_distributions`` compute its index once per ``sys.path`` (what it walks)
    in this process; each caller gets its own copy of the mapping."""
    current = importlib.metadata.packages_distributions
    if getattr(current, "megaflow_memoized", False):
        return
    index = functools.lru_cache(maxsize=4)(lambda path: current())

    def packages_distributions() -> dict[str, list[str]]:
        return {name: list(dists) for name, dists in index(tuple(sys.path)).items()}
    packages_distributions.megaflow_memoized = True
    packages_distributions.__wrapped__ = current
    packages_distributions.__doc__ = current.__doc__
    importlib.metadata.packages_distributions = packages_distributions


def install_import_guards() -> None:
    """Install the import guards once. The process environment is left alone: what the ``megaflow`` command needs
    (HF_HUB_OFFLINE, ...) its ``main`` sets (megaflow.cli)."""
    reasons = {} if has_libcuda() else dict.fromkeys(_BLOCKED_WITHOUT_LIBCUDA, "libcuda is not available")
    if os.environ.get(ENGINE_WORKER_VAR) == "1":
        reasons.update(dict.fromkeys(_BLOCKED_IN_ENGINE_WORKERS, "an SGLang engine worker does not use it"))
    if reasons and not any(isinstance(f, _BlockFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _BlockFinder(reasons))


def ignore_terminal_interrupt_in_engine_workers() -> None:
    """In an engine worker (``ENGINE_WORKER_VAR``), SIGINT is ignored from here on (see the module docstring)."""
    if os.environ.get(ENGINE_WORKER_VAR) == "1" and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
