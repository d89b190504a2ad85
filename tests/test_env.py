"""megaflow's process-wide import settings (``megaflow._env``): the memoized package index answers as the stdlib's
own walk does, and a process marked as an SGLang engine worker cannot import megatron while any other can."""
from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import megaflow  # noqa: F401  (installs the settings under test)
from megaflow._env import ENGINE_WORKER_VAR

PROBE = """import importlib.util, megaflow
try:
    print('found' if importlib.util.find_spec('megatron') else 'absent')
except ImportError as e:
    print('blocked:', e)
"""


def test_package_index_is_memoized_and_equals_the_stdlib_walk():
    index = importlib.metadata.packages_distributions
    assert index.megaflow_memoized
    first = index()
    assert first == index.__wrapped__() and "torch" in first
    first["torch"].append("not-a-distribution")
    first["no-such-package"] = ["x"]
    assert "not-a-distribution" not in index()["torch"] and "no-such-package" not in index()  # copies, not the cache


def test_package_index_follows_sys_path(monkeypatch, tmp_path):
    """The index is of what ``sys.path`` holds when it is asked (pytest and site dirs change it): a distribution
    added on a new path entry appears, as the stdlib's walk finds it."""
    before = importlib.metadata.packages_distributions()
    dist = tmp_path / "megaflow_probe_dist-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: megaflow-probe-dist\nVersion: 1.0\n")
    (dist / "top_level.txt").write_text("megaflow_probe_pkg\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    after = importlib.metadata.packages_distributions()
    assert "megaflow_probe_pkg" not in before and after["megaflow_probe_pkg"] == ["megaflow-probe-dist"]
    assert after == importlib.metadata.packages_distributions.__wrapped__()


def test_engine_workers_cannot_import_megatron_and_other_processes_can():
    env = {k: v for k, v in os.environ.items() if k != ENGINE_WORKER_VAR}
    plain = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    worker = subprocess.run([sys.executable, "-c", PROBE], env={**env, ENGINE_WORKER_VAR: "1"}, capture_output=True,
                            text=True, timeout=120)
    assert plain.stdout.strip() == "found", plain.stderr[-2000:]
    assert worker.stdout.strip() == "blocked: megatron disabled by megaflow: an SGLang engine worker does not use it", \
        worker.stderr[-2000:]
