"""tools/record_loop_rows.py (needs: CPU, < 1 s): what it refuses, and that the shipped reference rows are what
it writes. Running it (two tiny trainings) is what tests/run/test_loop.py compares against."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("record_loop_rows", REPO / "tools" / "record_loop_rows.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_refuses_a_tree_that_is_not_a_checkout_and_an_existing_file(tmp_path, capsys):
    tool = _tool()
    assert tool.main(["--tree", str(tmp_path), "--out", str(tmp_path / "rows.json")]) == 2
    assert "is not a megaflow checkout" in capsys.readouterr().err
    existing = tmp_path / "rows.json"
    existing.write_text("{}")
    assert tool.main(["--tree", str(REPO), "--out", str(existing)]) == 2
    assert "exists; not overwriting" in capsys.readouterr().err
    assert existing.read_text() == "{}"


def test_shipped_rows_hold_the_tools_runs_without_time_or_memory():
    tool = _tool()
    shipped = json.loads((REPO / "tests" / "run" / "data" / "synchronous_rows.json").read_text())
    assert shipped["config"] == tool.CONFIG
    assert {name: run["settings"] for name, run in shipped["runs"].items()} == tool.RUNS
    for run in shipped["runs"].values():
        keys = {k for row in run["rows"] for k in row}
        assert not [k for k in keys if tool.measures_time_or_memory(k)]
        assert {"reward/total", "train/policy_loss", "train/grad_norm", "sync/mbytes"} <= keys
    assert tool.measures_time_or_memory("time/iteration_s") and tool.measures_time_or_memory("sync/seconds")
    assert tool.measures_time_or_memory("mem/rss_mib_train") and not tool.measures_time_or_memory("reward/total")
