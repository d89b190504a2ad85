"""Confined patching of megatron-core: ``torch_view_patch`` (a layered ``torch`` stand-in in listed megatron
modules only; torch itself never modified) and ``set_attrs``. Every patch body returns its undo.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import sys
from typing import Callable

import torch

MCORE_VERSION = "0.19.2"
"""The megatron-core version the shims and patches were written and tested against."""


def installed_mcore_version() -> str:
    """megatron-core's installed distribution version (package_info.__version__ may carry a +git tag)."""
    return importlib.metadata.version("megatron-core")


# ---------------------------------------------------------------------------------------------
# Mechanism 1: a per-module view of `torch` with a few CUDA entry points routed to the CPU.


class _CudaView:
    """Stands in for ``torch.cuda`` inside one megatron module; overrides win, rest forwards."""

    def __init__(self, torch_view: "_TorchView"):
        self._torch_view = torch_view

    def __getattr__(self, name):
        return self.__dict__["_torch_view"]._resolve(self, "cuda", name, torch.cuda)


class _TorchView:
    """Stands in for ``torch`` inside one megatron module: layered overrides win, the rest forwards; resolved names
    are cached until a layer changes."""

    def __init__(self):
        self._layers: dict[object, dict[str, dict]] = {}  # shim token -> {"torch"|"cuda": overrides}
        self._cached: list[tuple[object, str]] = []
        self.cuda = _CudaView(self)

    def _lookup(self, namespace: str, name: str, fallback):
        for layer in self.__dict__["_layers"].values():
            if name in layer[namespace]:
                return layer[namespace][name]
        return getattr(fallback, name)

    def _resolve(self, holder, namespace: str, name: str, fallback):
        value = self._lookup(namespace, name, fallback)
        holder.__dict__[name] = value
        self.__dict__["_cached"].append((holder, name))
        return value

    def __getattr__(self, name):
        return self._resolve(self, "torch", name, torch)

    def set_layer(self, token, layer: dict | None) -> None:
        """Add (``layer``) or remove (``None``) the overrides of one shim; drops the name cache."""
        if layer is None:
            del self._layers[token]
        else:
            self._layers[token] = layer
        for holder, name in self._cached:
            holder.__dict__.pop(name, None)
        self._cached.clear()


_VIEWS: dict[str, _TorchView] = {}


def torch_view_patch(modules: tuple[str, ...], *, torch_attrs=None, cuda_attrs=None):
    """A shim body giving each module a torch view with these overrides; returns its undo."""
    layer = {"torch": dict(torch_attrs or {}), "cuda": dict(cuda_attrs or {})}

    def apply() -> Callable[[], None]:
        token = object()
        for name in modules:
            module = importlib.import_module(name)
            if name not in _VIEWS:
                assert module.torch is torch, f"{name}.torch is not torch"
                _VIEWS[name] = module.torch = _TorchView()
            _VIEWS[name].set_layer(token, layer)

        def undo():
            for name in modules:
                view = _VIEWS[name]
                view.set_layer(token, None)
                if not view._layers:
                    sys.modules[name].torch = torch
                    del _VIEWS[name]

        return undo

    return apply


def set_attrs(patches: list[tuple[object, str, object]]) -> Callable[[], None]:
    """Set each (owner, name, value); return an undo restoring the originals (or deleting)."""
    saved = [(owner, name, owner.__dict__.get(name, _MISSING)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)

    def undo():
        for owner, name, old in reversed(saved):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)

    return undo


_MISSING = object()


def check_known(table: dict, names, what: str) -> None:
    """ValueError naming the entries of ``names`` that ``table`` does not have (``what``: the table's name)."""
    unknown = set(names) - table.keys()
    if unknown:
        raise ValueError(f"unknown {what} {sorted(unknown)}; known: {sorted(table)}")


def apply_table(table: dict, applied: dict[str, Callable[[], None]], skip) -> list[str]:
    """Apply every entry of ``table`` (name -> object with ``apply() -> undo``) not in ``skip`` and not yet in
    ``applied`` (which records each undo); returns the names now applied."""
    for name, entry in table.items():
        if name not in skip and name not in applied:
            applied[name] = entry.apply()
    return sorted(applied)


def remove_applied(applied: dict[str, Callable[[], None]], names: set[str] | None = None) -> None:
    """Undo the given entries of ``applied`` (default: all), newest first."""
    for name in reversed(list(applied)):
        if names is None or name in names:
            applied.pop(name)()
