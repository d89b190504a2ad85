"""Shared pytest fixtures (keep minimal)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_tiny_pipeline_tool():
    """``tools/make_tiny_pipeline.py`` as a module (tools/ is not a package on sys.path in tests);
    it re-exports ``megaflow.models.tiny_pipeline``, so this also checks the CLI shim imports."""
    spec = importlib.util.spec_from_file_location("make_tiny_pipeline", REPO / "tools" / "make_tiny_pipeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_sd3_dir(tmp_path_factory) -> Path:
    """A tiny SD3 diffusers pipeline directory (seed 0), written once per session (~2 MB, ~2 s)."""
    return load_tiny_pipeline_tool().make_tiny_pipeline("sd3", tmp_path_factory.mktemp("tiny-sd3"), seed=0)


@pytest.fixture(scope="session")
def tiny_pipeline_tool():
    """The ``tools/make_tiny_pipeline.py`` module."""
    return load_tiny_pipeline_tool()
