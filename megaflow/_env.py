"""Process-wide import guards, applied on ``import megaflow`` (cheap: no torch import; no environment variable set).

flash_mla (pulled in by sglang's install) ships a CUDA extension whose import raises ``OSError``
when libcuda is absent. megatron-core probes it with ``try: import flash_mla except ImportError``,
so the OSError escapes and breaks ``import megatron.core.models``. On machines without libcuda we
make ``flash_mla`` unimportable (ImportError), which is exactly what megatron expects for "not
installed". On GPU machines nothing is changed.
"""
from __future__ import annotations

import ctypes.util
import importlib.abc
import sys

_BLOCKED_WITHOUT_LIBCUDA = ("flash_mla",)


class _BlockFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder that raises ImportError for a fixed set of top-level modules."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):  # noqa: D401 - importlib API
        if fullname.split(".")[0] in self.names:
            raise ImportError(f"{fullname} disabled by megaflow: libcuda is not available on this machine")
        return None


def has_libcuda() -> bool:
    """True when the CUDA driver library can be found (a GPU machine)."""
    return ctypes.util.find_library("cuda") is not None


def install_import_guards() -> None:
    """Install the import guards once. The process environment is left alone: what the ``megaflow`` command needs
    (HF_HUB_OFFLINE, ...) its ``main`` sets (megaflow.cli)."""
    if has_libcuda():
        return
    if not any(isinstance(f, _BlockFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _BlockFinder(_BLOCKED_WITHOUT_LIBCUDA))
