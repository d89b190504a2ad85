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


# Seconds the slowest test files took on one worker of scripts/test.sh (2-core machine, busy, Nov 29; see
# docs/results.md, "Test suite time"). Only their order matters: scripts/test.sh hands whole
# files to its workers in collection order (--dist loadfile --no-loadscope-reorder), and starting the longest first
# lets the short ones fill in at the end, so neither worker waits idle while the other runs a long file. Files not
# named here follow, those with a slow test first. Refresh from the durations table a run prints.
FILE_SECONDS = {
    "tests/run/test_resume.py": 630, "tests/run/test_qwen_image_runs.py": 340, "tests/run/test_loop.py": 320,
    "tests/run/test_clean_algorithms.py": 300, "tests/run/test_resume_async.py": 290,
    "tests/pretrain/test_pretrain_e2e.py": 220, "tests/run/test_launch_multinode.py": 190,
    "tests/run/test_engine_rank.py": 150, "tests/tools/test_gpu_engine_checks.py": 130,
    "tests/pretrain/test_pretrain_parallel.py": 115, "tests/run/test_ctrl_c.py": 90, "tests/run/test_masked_run.py": 80,
    "tests/tools/test_make_tiny_pipeline.py": 65, "tests/models/test_parallel_parity.py": 60,
}


def pytest_collection_modifyitems(config, items):
    """Run whole files longest first (FILE_SECONDS, then files with a slow test); tests keep their order within a
    file (its module fixtures are shared in that order)."""
    def weight(item) -> tuple[int, bool]:
        rel = Path(str(item.path)).relative_to(REPO).as_posix()
        return -FILE_SECONDS.get(rel, 0), rel not in slow_files

    slow_files = {Path(str(i.path)).relative_to(REPO).as_posix() for i in items if i.get_closest_marker("slow")}
    items.sort(key=weight)  # stable: within a weight, collection order (so within a file, its own order)
