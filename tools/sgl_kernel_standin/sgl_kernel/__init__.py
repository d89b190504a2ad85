"""A stand-in for ``sgl_kernel`` (the sglang-kernel package) on the bare GPU machines of scripts/gpu_check.sh ONLY.

sglang 0.5.23 imports names of ``sgl_kernel`` at module level, unguarded, wherever torch sees CUDA (layernorm,
sampler and quantization layers); the real package is a 356 MiB wheel pinned to torch 2.14, more than the 64 MiB a
GPU check can carry. With CUDA, this package lets those imports succeed: every top-level name is a placeholder, and
calling one, or reading anything off it, raises ``SglKernelUnavailable`` naming the kernel, so a run that finishes
used no kernel of it. Of its submodules only ``UNGUARDED_SUBMODULES`` exist (stand-ins the same way: sglang imports
them unguarded); the others (``sgl_kernel.flash_attn``, ``.scalar_type``, ...) do not, so sglang's guarded imports
of them take their fallbacks, as without the package. Without CUDA it refuses to import
(ImportError), as the real CUDA package does on a CPU host: sglang then runs exactly as it would without it. A real
GPU install keeps the real ``sglang[diffusion]`` (with sglang-kernel) and never sees this package.

``SGL_KERNEL_STANDIN_LOG`` (a file path): each import (or refusal) and every name looked up are appended to it, one
line each, so a check can show which kernels a run reached. ``SGL_KERNEL_STANDIN_FORCE=1`` imports it without CUDA
(the CPU tests of the placeholders only).
"""
from __future__ import annotations

import os
import sys
import types

__version__ = "0.0.0+megaflow.standin"
STANDIN = True
"""Marks this package as megaflow's stand-in (``getattr(sgl_kernel, "STANDIN", False)``)."""
UNGUARDED_SUBMODULES = ("quantization", "kvcacheio")
"""Submodules sglang 0.5.23 imports at module level without a fallback on the engine's import path with CUDA
(``sglang.srt.layers.quantization.gguf``: ``from sgl_kernel.quantization import ...``; the CLIP encoder, through
``sglang.srt.model_executor`` and the LLM KV cache: ``from sgl_kernel.kvcacheio import ...``)."""


class SglKernelUnavailable(RuntimeError):
    """A kernel of sgl_kernel was used, but only megaflow's stand-in is installed."""


def _note(line: str) -> None:
    path = os.environ.get("SGL_KERNEL_STANDIN_LOG")
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {line}\n")


def _unavailable(name: str) -> SglKernelUnavailable:
    return SglKernelUnavailable(
        f"{name} is a kernel of sgl_kernel, but only megaflow's stand-in is installed (the slim wheelhouse of "
        "scripts/gpu_wheels.sh for bare GPU machines); this path needs the real sglang-kernel: install "
        "sglang[diffusion], or choose a path without it (attention_backend='torch_sdpa', "
        "SGLANG_ENABLE_DETERMINISTIC_INFERENCE=1, fp32)")


class _Placeholder:
    """What ``sgl_kernel.<name>`` resolves to: importable, unusable."""

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def __call__(self, *args, **kwargs):
        raise _unavailable(self._name)

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        raise _unavailable(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<sgl_kernel stand-in placeholder {self._name}>"


class _StandinModule(types.ModuleType):
    """``sgl_kernel``: any public name is a placeholder (dunder names behave as usual)."""

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        _note(f"lookup {self.__name__}.{attr}")
        return _Placeholder(f"{self.__name__}.{attr}")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if os.environ.get("SGL_KERNEL_STANDIN_FORCE") != "1" and not _cuda():
    _note(f"refused {__name__} (no CUDA)")
    raise ImportError("sgl_kernel: megaflow's stand-in imports only where torch sees CUDA (here it does not)")
sys.modules[__name__].__class__ = _StandinModule
for _sub in UNGUARDED_SUBMODULES:
    sys.modules[f"{__name__}.{_sub}"] = _StandinModule(f"{__name__}.{_sub}")
_note(f"import {__name__}")
